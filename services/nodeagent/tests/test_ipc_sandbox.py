"""The communication plane in sandboxes: the broker's socket, the SDK and pinned identities.

Pure parts (layout, environment, cgroup parsing) are unit tests; the rest runs real sandboxes
(root) against a broker on the test's event loop, identifying processes as the node agent does.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kits
from _dsec_sandbox_testkit import Recorder, managed, read_json_output, run_to_end, snippet_config
from dsec_core.metrics import MetricsServer
from dsec_core.settings import Settings
from dsec_sdk import BrokerUnavailable, DSecClient

from dsec_nodeagent.communication import CommunicationPlane, broker_limits, sandbox_of
from dsec_nodeagent.ipc import AgentKey, Broker
from dsec_nodeagent.sandbox import AgentIdentity, SandboxConfig, SandboxManager, cgroups, plan
from dsec_nodeagent.sandbox.discovery import RuntimeView

VIEW = RuntimeView(
    executable="/opt/py/bin/python3.11",
    version="3.11",
    ro_dirs=["/opt/py"],
    ro_files=[],
    symlinks=[],
)
FACTS = plan.KernelFacts(
    landlock_abi=7, cap_last_cap=40, seccomp_program=b"\0" * 8, cgroup_procs=[]
)
RESEARCHER = AgentIdentity(name="researcher", task_group="team")


# --------------------------------------------------------------------------- pure


def _plan(tmp: Path, host_fields: dict[str, Any], **config: Any) -> dict[str, Any]:
    host = plan.HostPaths(
        root=tmp / "root",
        exit_path=tmp / "exit.json",
        data_dir=tmp / "data",
        semantic_site=tmp,
        **host_fields,
    )
    fields: dict[str, Any] = {
        "sandbox_id": "s1",
        "argv": ["python", "-c", "1"],
        "runtime": Path("/opt/py/bin/python3.11"),
        **config,
    }
    return plan.build(SandboxConfig(**fields), VIEW, host, FACTS, uid=1).plan


@pytest.mark.unit
def test_an_agent_sees_only_its_socket_directory_and_the_sdk(tmp_path: Path) -> None:
    ipc, sdk, msgpack = tmp_path / "ipc", tmp_path / "dsec_sdk", tmp_path / "msgpack"
    for path in (ipc, sdk, msgpack):
        path.mkdir()
    built = _plan(
        tmp_path,
        {"ipc_dir": ipc, "sdk_packages": (sdk,), "sdk_fallbacks": (msgpack,)},
        agent=RESEARCHER,
        env={"DSEC_AGENT_NAME": "someone-else"},
    )
    binds = {e["path"]: (e["src"], e["ro"]) for e in built["layout"] if e["kind"] == "bind"}
    assert binds["/run/dsec/ipc"] == (str(ipc), True)
    assert binds["/opt/dsec/sdk/dsec_sdk"] == (str(sdk), True)
    assert binds["/opt/dsec/sdk-deps/msgpack"] == (str(msgpack), True)
    env = built["env"]
    assert env["DSEC_IPC_SOCKET"] == "/run/dsec/ipc/ipc.sock"
    assert env["DSEC_AGENT_NAME"] == "researcher"  # the spec's own env cannot rename it
    assert env["DSEC_TASK_GROUP"] == "team"
    assert env["PYTHONPATH"] == "/opt/dsec/sdk"
    assert env["PYTHONUSERBASE"] == "/opt/dsec/user"
    assert env["DSEC_SDK_DEPS"] == "/opt/dsec/sdk-deps"
    assert {"/opt/dsec/sdk", "/opt/dsec/sdk-deps"} <= set(built["landlock"]["read"])
    assert not any(p.startswith("/run/dsec") for p in built["landlock"]["write"])


@pytest.mark.unit
def test_a_sandbox_without_an_agent_identity_gets_no_communication_plane(tmp_path: Path) -> None:
    built = _plan(tmp_path, {})
    assert not any(
        e["path"].startswith(("/run/dsec/ipc", "/opt/dsec/sdk")) for e in built["layout"]
    )
    assert not any(k in built["env"] for k in ("DSEC_IPC_SOCKET", "DSEC_AGENT_NAME"))


@pytest.mark.unit
def test_without_a_broker_the_agent_still_knows_who_it_is_and_where_the_socket_would_be(
    tmp_path: Path,
) -> None:
    built = _plan(tmp_path, {}, agent=RESEARCHER)
    assert not any(e["path"] == "/run/dsec/ipc" for e in built["layout"])
    # the SDK then fails with BrokerUnavailable naming this path, not with a missing import
    assert built["env"]["DSEC_IPC_SOCKET"] == "/run/dsec/ipc/ipc.sock"
    assert built["env"]["DSEC_AGENT_NAME"] == "researcher"


@pytest.mark.unit
def test_an_agent_identity_must_be_a_valid_agent_name() -> None:
    with pytest.raises(ValueError, match="'bad name'"):
        AgentIdentity(name="bad name", task_group="team")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "sandbox"),
    [
        ("0::/dsec/node-1/sbx_01abc\n", "sbx_01abc"),
        ("9:name=systemd:/\n4:memory:/dsec/node-1/sbx_1\n0::/dsec/node-2/sbx_2\n", "sbx_2"),
        ("0::/\n", None),
        ("0::/dsec/node-1\n", None),  # a node's parent, not a sandbox
        ("0::/user.slice/dsec/node-1/sbx_1\n", None),
        ("4:memory:/dsec/node-1/sbx_1\n", None),
    ],
)
def test_the_sandbox_of_a_process_comes_from_its_cgroup_v2_line(
    text: str, sandbox: str | None
) -> None:
    assert cgroups.sandbox_of_cgroup(text) == sandbox


@pytest.mark.unit
def test_remote_calls_travel_outside_the_event_streams_subjects() -> None:
    # `dsec.>` belongs to the DSEC_EVENTS stream: JetStream would answer (and record) requests.
    assert not AgentKey("team", "researcher").subject("lookup").startswith("dsec.")


# --------------------------------------------------------------------------- kernel

SERVER = r"""
from dsec_sdk import DSecClient
client = DSecClient()

@client.tool("lookup")
def lookup(query):
    return {"query": query, "by": client.agent, "blob": "x" * 300_000 if query == "big" else ""}

@client.tool("shutdown")
def shutdown():
    client.stop()
    return "bye"

client.serve()
"""

CALLER = r"""
import json, os, time
from dsec_sdk import AgentNotFound, BrokerUnavailable, DSecClient

report = {}
client = DSecClient()
deadline = time.monotonic() + 20
while True:
    try:
        report["small"] = client.call_tool("researcher", "lookup", query="memfd")
        break
    except AgentNotFound:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
# larger than a ring: travels through a separate memfd
report["big"] = len(client.call_tool("researcher", "lookup", query="big")["blob"])
for _ in range(200):
    client.call_tool("researcher", "lookup", query="again")
try:
    DSecClient("researcher").call_tool("researcher", "lookup", query="x")
    report["impostor"] = "accepted"
except BrokerUnavailable as exc:
    report["impostor"] = str(exc)
try:
    report["listing"] = os.listdir("/run/dsec/ipc")
except OSError as exc:
    report["listing"] = type(exc).__name__
report["node_files"] = os.path.exists(os.environ["HOST_RUN_DIR"])
report["bye"] = client.call_tool("researcher", "shutdown")
print(json.dumps(report))
"""


class _Plane:
    """A broker identifying processes through a manager, as the node agent wires it."""

    def __init__(self, home: Path, manager: SandboxManager) -> None:
        settings = Settings(home=home)
        self.plane = CommunicationPlane(settings)
        self.plane.attach(manager)
        self.broker = Broker(
            self.plane.socket_path,
            identify=self.plane.identify,
            limits=broker_limits(settings),  # the operator's defaults, as the node agent has
            sandbox_of=sandbox_of,
        )


def _agent(
    sandbox_id: str, code: str, tmp: Path, name: str, tenant: str = "default", **fields: Any
) -> SandboxConfig:
    return snippet_config(
        sandbox_id,
        code,
        tmp,
        agent=AgentIdentity(name=name, task_group="team", tenant=tenant),
        limits={"pids": 64},
        timeout_s=60,
        **fields,
    )


@pytest.mark.kernel
async def test_two_sandboxed_agents_call_each_other_and_cannot_pose_as_another(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    socket_path = CommunicationPlane(Settings(home=home)).socket_path
    async with managed(home, Recorder(), ipc_socket=socket_path) as manager:
        plane = _Plane(home, manager)
        await plane.broker.start()
        try:
            await manager.launch(_agent("ipc-srv", SERVER, tmp_path, "researcher"))
            caller = _agent(
                "ipc-cli", CALLER, tmp_path, "planner", env={"HOST_RUN_DIR": str(home / "run")}
            )
            result = await run_to_end(manager, caller)
            report = read_json_output(result)
            server = await manager.wait("ipc-srv")
        finally:
            await plane.broker.stop()
    assert result.exit_code == 0
    assert report["small"] == {"query": "memfd", "by": "researcher", "blob": ""}
    assert report["big"] == 300_000
    assert "may not act as team/researcher" in report["impostor"]
    assert report["listing"] == "PermissionError"  # connect works; looking around does not
    assert report["node_files"] is False
    assert report["bye"] == "bye"
    assert server.exit_code == 0


@pytest.mark.kernel
async def test_a_process_outside_every_sandbox_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    manager = SandboxManager(home)
    plane = _Plane(home, manager)
    await plane.broker.start()
    try:
        client = DSecClient("researcher", "team", socket_path=plane.plane.socket_path)
        with pytest.raises(BrokerUnavailable, match="may not act as team/researcher"):
            await client.acall_tool("planner", "lookup", query="x")
        client.close()
    finally:
        await plane.broker.stop()


PROBE = r"""
import sys
from dsec_sdk import AgentNotFound, DSecClient
try:
    DSecClient().call_tool("nobody", "lookup")
except AgentNotFound:
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.kernel
async def test_a_restarted_node_agent_shows_running_sandboxes_its_new_socket(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    socket_path = CommunicationPlane(Settings(home=home)).socket_path
    async with managed(home, Recorder(), ipc_socket=socket_path) as first:
        plane = _Plane(home, first)
        await plane.broker.start()
        ready = await first.launch(
            _agent("ipc-idle", "import time; time.sleep(60)", tmp_path, "idle")
        )
        await plane.broker.stop()
        await first.shutdown()  # the node agent stops; the sandbox keeps running

        second = SandboxManager(home, ipc_socket=socket_path)
        plane = _Plane(home, second)
        await plane.broker.start()  # a new socket inode at the same path
        try:
            assert (await second.reconcile()).adopted == ["ipc-idle"]
            link = home / "run" / "sandboxes" / "ipc-idle" / "ipc" / "ipc.sock"
            assert os.stat(link).st_ino == os.stat(socket_path).st_ino
            # a process of the adopted sandbox still connects, and as that sandbox's agent
            code = await second.exec("ipc-idle", ["python", "-c", PROBE])
            assert code == 0
            # the sandbox's pid 1 shares its cgroup but runs as root: not the agent
            idle = AgentIdentity(name="idle", task_group="team")
            assert second.identify(ready.pid, ready.uid) == idle
            assert second.identify(ready.pid, 0) is None
            assert second.identify(os.getpid(), ready.uid) is None
            await second.stop("ipc-idle", grace_s=0.5)
        finally:
            await plane.broker.stop()


# --------------------------------------------------------------------------- hostile neighbours

FLOOD = r"""
import os, socket, sys, time
socks, errors = [], 0
for _ in range(600):  # connections that never say hello
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(os.environ["DSEC_IPC_SOCKET"])
        socks.append(sock)
    except OSError:
        sock.close()
        errors += 1
print(len(socks), errors, flush=True)
time.sleep(60)
"""

PLANNER = r"""
import json, time
from dsec_sdk import AgentNotFound, DSecClient
client = DSecClient(timeout=10)
deadline = time.monotonic() + 20
while True:
    try:
        answer = client.call_tool("researcher", "lookup", query="through")
        break
    except AgentNotFound:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
print(json.dumps({"answer": answer, "bye": client.call_tool("researcher", "shutdown")}))
"""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _until(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _metric(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.kernel
async def test_a_connection_flood_from_a_sandbox_leaves_a_victim_and_healthz_working(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    socket_path = CommunicationPlane(Settings(home=home)).socket_path
    health = MetricsServer("nodeagent", "test", lambda: True)
    port = await health.start(0)
    async with managed(home, Recorder(), ipc_socket=socket_path) as manager:
        plane = _Plane(home, manager)
        await plane.broker.start()
        refused = _metric("dsec_ipc_refusals_total", reason="pending_sandbox")
        fds = _fds()
        try:
            await manager.launch(_agent("ipc-flood", FLOOD, tmp_path, "flooder"))
            # The flood is on: beyond its 8 waiting connections, each one is turned away.
            await _until(
                lambda: (
                    _metric("dsec_ipc_refusals_total", reason="pending_sandbox") - refused >= 500
                ),
                "the flood to be turned away",
            )
            assert _metric("dsec_ipc_pending_connections") <= 8
            assert _fds() - fds < 80  # 600 connections did not become 600+ fds here
            async with aiohttp.ClientSession() as http:
                started = time.monotonic()
                async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                    assert response.status == 200
                assert time.monotonic() - started < 2
            await manager.launch(_agent("ipc-victim", SERVER, tmp_path, "researcher"))
            result = await run_to_end(manager, _agent("ipc-plan", PLANNER, tmp_path, "planner"))
            report = read_json_output(result)
            await manager.stop("ipc-flood", grace_s=0.2)
        finally:
            await plane.broker.stop()
            await health.stop()
    assert result.exit_code == 0
    assert report["answer"]["query"] == "through"
    assert report["bye"] == "bye"


TENANT_SERVER = r"""
import os
from dsec_sdk import DSecClient
client = DSecClient()
client.serve({"who": lambda: os.environ["WHO"], "shutdown": lambda: client.stop() or "bye"})
"""

TENANT_CALLER = r"""
import json, time
from dsec_sdk import AgentNotFound, BrokerUnavailable, DSecClient
report = {}
if SERVE_TOO:
    try:
        DSecClient().serve({"who": lambda: "impostor"})
        report["serve"] = "accepted"
    except BrokerUnavailable as exc:
        report["serve"] = str(exc)
client = DSecClient(PLANNER_NAME, timeout=10)
deadline = time.monotonic() + 20
while True:
    try:
        report["who"] = client.call_tool("researcher", "who")
        break
    except (AgentNotFound, BrokerUnavailable):
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
report["bye"] = client.call_tool("researcher", "shutdown")
print(json.dumps(report))
"""


@pytest.mark.kernel
async def test_a_second_tenant_with_the_same_group_and_names_cannot_reach_or_pose(
    tmp_path: Path,
) -> None:
    """Tenant evil starts "researcher" of group "team" first; acme's own researcher is still
    accepted and acme's planner reaches it alone. A second evil sandbox named researcher
    cannot take the name from the live one, and reaches only its own tenant's agent."""
    home = tmp_path / "home"
    socket_path = CommunicationPlane(Settings(home=home)).socket_path
    async with managed(home, Recorder(), ipc_socket=socket_path) as manager:
        plane = _Plane(home, manager)
        await plane.broker.start()
        try:
            env = {"WHO": "evil"}
            await manager.launch(
                _agent("t-evil-res", TENANT_SERVER, tmp_path, "researcher", "evil", env=env)
            )
            evil = AgentKey("team", "researcher", "evil")
            await _until(lambda: plane.broker.local_server(evil), "evil's researcher")
            env = {"WHO": "acme"}
            await manager.launch(
                _agent("t-acme-res", TENANT_SERVER, tmp_path, "researcher", "acme", env=env)
            )
            planner = TENANT_CALLER.replace("SERVE_TOO", "False").replace("PLANNER_NAME", "None")
            acme = await run_to_end(
                manager, _agent("t-acme-plan", planner, tmp_path, "planner", "acme")
            )
            # The joiner's spec also says "researcher" (its own name) in group team, tenant evil.
            joiner_code = TENANT_CALLER.replace("SERVE_TOO", "True").replace("PLANNER_NAME", "None")
            joiner = await run_to_end(
                manager, _agent("t-evil-join", joiner_code, tmp_path, "researcher", "evil")
            )
            servers = [await manager.wait(s) for s in ("t-evil-res", "t-acme-res")]
        finally:
            await plane.broker.stop()
    acme_report, joiner_report = read_json_output(acme), read_json_output(joiner)
    assert acme_report == {"who": "acme", "bye": "bye"}
    assert joiner_report["who"] == "evil"  # its own tenant's researcher, never acme's
    assert (
        "is already served by another live process of sandbox t-evil-res"
        in (joiner_report["serve"])
    )
    assert [s.exit_code for s in servers] == [0, 0]


GROW_ATTACK = r"""
import json, os, time
from dsec_sdk import AgentNotFound, DSecClient, PeerGone
from dsec_sdk.ipc import ring as r
client = DSecClient(timeout=5)
deadline = time.monotonic() + 20
while True:
    try:
        client.call_tool("researcher", "lookup", query="hello")
        break
    except AgentNotFound:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
end = client._channels["researcher"].end
report = {}
try:
    os.ftruncate(end._fds[1], 1 << 48)  # the request overflow memfd
    report["grow"] = "grown"
except OSError as exc:
    report["grow"] = type(exc).__name__
ring = end.requests
head = ring.hdr[r.HEAD]
ring.hdr[r.LARGE_WRITTEN] = ring.hdr[r.LARGE_WRITTEN] + 1
r.RECORD.pack_into(ring._data, head & (ring.capacity - 1), 2**32 - 1, r.REC_LARGE, 1, 0, 99)
ring.hdr[r.HEAD] = head + 16
os.eventfd_write(ring.consumer_wake_fd, 1)
try:
    client.call_tool("researcher", "lookup", query="again")
    report["after"] = "answered"
except PeerGone as exc:
    report["after"] = str(exc)
print(json.dumps(report))
"""


@pytest.mark.kernel
async def test_growing_the_overflow_memfd_fails_and_the_server_keeps_serving_others(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    socket_path = CommunicationPlane(Settings(home=home)).socket_path
    async with managed(home, Recorder(), ipc_socket=socket_path) as manager:
        plane = _Plane(home, manager)
        await plane.broker.start()
        try:
            await manager.launch(_agent("g-srv", SERVER, tmp_path, "researcher"))
            attack = await run_to_end(manager, _agent("g-evil", GROW_ATTACK, tmp_path, "mallory"))
            good = await run_to_end(manager, _agent("g-plan", PLANNER, tmp_path, "planner"))
            server = await manager.wait("g-srv")
        finally:
            await plane.broker.stop()
    report = read_json_output(attack)
    assert report["grow"] == "PermissionError"  # sealed against growing
    assert "closed the channel" in report["after"]  # the server dropped that channel only
    assert read_json_output(good) == {
        "answer": {"query": "through", "by": "researcher", "blob": ""},
        "bye": "bye",
    }
    assert server.exit_code == 0  # serve() never ended on the attack
