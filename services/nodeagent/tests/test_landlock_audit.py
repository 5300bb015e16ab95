"""Every file access Landlock refuses inside a sandbox becomes one report naming the path (root).

The sandbox makes each forbidden access once — directly, through a symlink and through ctypes —
plus permitted ones; the test asserts what the process saw (``EACCES``) and what the node agent's
audit reader handed on. Records arrive asynchronously: the workload's last action is one more
refused read (the sentinel), and the kernel delivers records in order, so once the sentinel's
report is in, every earlier one is too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import managed, read_json_output, run_to_end, snippet_config

from dsec_nodeagent.sandbox import Mount, audit
from dsec_nodeagent.sandbox.audit import LandlockRefusal

WORKLOAD = r"""
import ctypes, errno, json, os

libc = ctypes.CDLL(None, use_errno=True)
results = {}

def probe(name, fn):
    try:
        fn()
        results[name] = "ok"
    except OSError as exc:
        results[name] = errno.errorcode.get(exc.errno, str(exc))

def c_open(path, flags):
    fd = libc.open(path.encode(), flags)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.close(fd)

probe("write_allowed", lambda: open("/workspace/output/ok.txt", "w").write("ok"))
probe("read_allowed", lambda: open("/workspace/data/input.txt").read())
probe("write_existing", lambda: open("/workspace/scratch/existing.txt", "a").write("x"))
probe("create_new", lambda: open("/workspace/scratch/new.txt", "w"))
probe("read_direct", lambda: open("/workspace/private/direct.txt").read())
os.symlink("/workspace/private/linked.txt", "/workspace/output/link")
probe("read_via_symlink", lambda: open("/workspace/output/link").read())
probe("ctypes_read", lambda: c_open("/workspace/private/ctypes.txt", os.O_RDONLY))
probe("ctypes_write", lambda: c_open("/workspace/scratch/ctypes.txt", os.O_WRONLY))
probe("sentinel", lambda: open("/workspace/private/sentinel.txt").read())
print(json.dumps(results))
"""

EXPECTED = Counter(
    {
        ("write", "/workspace/scratch/existing.txt", ("fs.write_file",)): 1,
        ("create", "/workspace/scratch", ("fs.make_reg",)): 1,
        ("read", "/workspace/private/direct.txt", ("fs.read_file",)): 1,
        ("read", "/workspace/private/linked.txt", ("fs.read_file",)): 1,  # the symlink's target
        ("read", "/workspace/private/ctypes.txt", ("fs.read_file",)): 1,
        ("write", "/workspace/scratch/ctypes.txt", ("fs.write_file",)): 1,
        ("read", "/workspace/private/sentinel.txt", ("fs.read_file",)): 1,
    }
)


def _audit_status() -> audit.AuditStatus:
    with contextlib.closing(audit._control_socket()) as sock:
        return audit.get_status(sock)


def _state_to_come_back_to() -> audit.AuditStatus:
    """What audit's status should be once the test's reader has closed.

    The status as it is now, unless a reader that died without releasing (a killed node agent)
    left audit enabled with the state it found recorded, and no live reader remains: then the
    test's reader is the last one and restores that recorded state (CI once found audit left
    enabled by a process killed before the run).
    """
    with audit._SWITCH._host() as holders:
        previous = audit._SWITCH.host_dir / "previous.json"
        if previous.is_file() and not any(holders.iterdir()):
            return audit.AuditStatus(**json.loads(previous.read_text()))
    return _audit_status()


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the workload once under a manager that reads Landlock's audit records."""
    tmp = tmp_path_factory.mktemp("landlock-audit")
    come_back_to = _state_to_come_back_to()

    async def run() -> dict[str, Any]:
        data, private, scratch = tmp / "data", tmp / "private", tmp / "scratch"
        for directory in (data, private, scratch):
            directory.mkdir()
        (data / "input.txt").write_text("input")
        for name in ("direct", "linked", "ctypes", "sentinel"):
            (private / f"{name}.txt").write_text("secret")
        for name in ("existing", "ctypes"):
            (scratch / f"{name}.txt").write_text("")
            os.chmod(scratch / f"{name}.txt", 0o666)  # so that only Landlock can refuse
        os.chmod(scratch, 0o777)
        seen: list[LandlockRefusal] = []

        async def on_landlock_refusal(refusal: LandlockRefusal) -> None:
            seen.append(refusal)

        async with managed(tmp / "home", on_landlock_refusal=on_landlock_refusal) as manager:
            config = snippet_config(
                "ll-audit",
                WORKLOAD,
                tmp,
                mounts=[
                    Mount(source=data, target="/workspace/data"),
                    Mount(source=private, target="/workspace/private"),
                    Mount(source=scratch, target="/workspace/scratch", read_only=False),
                ],
                read_allowed=["/workspace/data", "/workspace/scratch"],
            )
            result = await run_to_end(manager, config)
            during = _audit_status()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while loop.time() < deadline and not any(
                r.target == "/workspace/private/sentinel.txt" for r in seen
            ):
                await asyncio.sleep(0.02)
        return {"report": read_json_output(result), "seen": seen, "during": during}

    outcome = asyncio.new_event_loop()
    try:
        found: dict[str, Any] = outcome.run_until_complete(run())
    finally:
        outcome.close()
    found["come_back_to"], found["after"] = come_back_to, _audit_status()
    return found


@pytest.mark.kernel
@pytest.mark.parametrize(
    ("action", "seen_by_process"),
    [
        ("write_allowed", "ok"),
        ("read_allowed", "ok"),
        ("write_existing", "EACCES"),
        ("create_new", "EACCES"),
        ("read_direct", "EACCES"),
        ("read_via_symlink", "EACCES"),
        ("ctypes_read", "EACCES"),
        ("ctypes_write", "EACCES"),
    ],
)
def test_the_process_sees_what_landlock_decided(
    audited: dict[str, Any], action: str, seen_by_process: str
) -> None:
    assert audited["report"][action] == seen_by_process


@pytest.mark.kernel
def test_each_refused_access_is_reported_once_naming_the_path(audited: dict[str, Any]) -> None:
    seen: list[LandlockRefusal] = audited["seen"]
    assert {r.sandbox_id for r in seen} == {"ll-audit"}
    # Exactly the refused attempts: nothing for the permitted accesses or interpreter start-up.
    assert Counter((r.operation, r.target, r.blockers) for r in seen) == EXPECTED
    assert all(r.domain for r in seen)


@pytest.mark.kernel
def test_the_report_says_landlock_refused_and_which_list_to_change(
    audited: dict[str, Any],
) -> None:
    seen: list[LandlockRefusal] = audited["seen"]
    write = next(r for r in seen if r.target == "/workspace/scratch/existing.txt")
    assert audit.describe(write).startswith(
        "Landlock refused write of /workspace/scratch/existing.txt ("
    )
    assert "blocked right fs.write_file) with EACCES" in audit.describe(write)
    assert audit.describe(write).endswith("outside the spec's write_allowed")
    read = next(r for r in seen if r.target == "/workspace/private/direct.txt")
    assert audit.describe(read).endswith("outside the spec's read_allowed")


@pytest.mark.kernel
def test_audit_is_enabled_while_reading_and_restored_after(audited: dict[str, Any]) -> None:
    assert audited["during"].enabled in (1, 2)
    expected, after = audited["come_back_to"], audited["after"]
    assert (after.enabled, after.backlog_limit, after.backlog_wait_time) == (
        expected.enabled,
        expected.backlog_limit,
        expected.backlog_wait_time,
    )


# ----------------------------------------------------------------------------- records, no kernel

ACCESS = (
    'audit(1796009056.066:{serial}): domain=1fe blockers={blockers} path={path} dev="vda" ino=7'
)
ALLOCATED = (
    "audit(1796009056.066:{serial}): domain=1fe status=allocated mode=enforcing "
    'pid=4242 uid=65001 exe="/usr/bin/python3.11" comm="python"'
)


@pytest.mark.unit
def test_record_fields_are_unquoted_and_hex_paths_decoded() -> None:
    parsed = audit.parse_record(
        ACCESS.format(
            serial=5, blockers="fs.write_file,fs.truncate", path="2F746D702F6120622E747874"
        )
    )
    assert parsed is not None
    serial, fields = parsed
    assert serial == 5
    assert fields["path"] == "/tmp/a b.txt"  # audit hex-encodes paths with spaces
    assert fields["blockers"] == "fs.write_file,fs.truncate"
    assert fields["dev"] == "vda"
    assert audit.parse_record("no header here") is None


@pytest.mark.unit
async def test_records_of_one_domain_are_attributed_after_its_process_is_gone() -> None:
    seen: list[LandlockRefusal] = []
    asked: list[tuple[int | None, int | None]] = []

    async def handler(refusal: LandlockRefusal) -> None:
        seen.append(refusal)

    def resolve(pid: int | None, uid: int | None) -> str | None:
        asked.append((pid, uid))
        return "sbx-a" if uid == 65001 else None

    reader = audit.LandlockAudit(resolve, handler)
    reader.add_record(
        audit.AUDIT_LANDLOCK_ACCESS,
        ACCESS.format(serial=1, blockers="fs.make_reg", path='"/workspace/scratch"'),
    )
    reader.add_record(audit.AUDIT_LANDLOCK_DOMAIN, ALLOCATED.format(serial=1))
    reader.add_record(audit.AUDIT_EOE, "audit(1796009056.066:1): ")
    # A later denial of the same domain: no domain record, no syscall record; still known.
    reader.add_record(
        audit.AUDIT_LANDLOCK_ACCESS,
        ACCESS.format(serial=2, blockers="fs.read_file", path='"/etc/x"'),
    )
    reader.add_record(audit.AUDIT_EOE, "audit(1796009056.066:2): ")
    await reader.close()
    assert asked == [(4242, 65001)]
    assert [(r.sandbox_id, r.operation, r.target, r.pid) for r in seen] == [
        ("sbx-a", "create", "/workspace/scratch", None),
        ("sbx-a", "read", "/etc/x", None),
    ]


@pytest.mark.unit
async def test_the_node_agent_publishes_a_kernel_policy_violation() -> None:
    from types import SimpleNamespace

    from dsec_core import events

    from dsec_nodeagent.agent import NodeAgent
    from dsec_nodeagent.outlet import EventOutlet
    from dsec_nodeagent.refusals import RefusalGate

    published: list[tuple[events.Payload, str, str | None]] = []

    async def publish(payload: events.Payload, sid: str, event_id: str | None) -> None:
        published.append((payload, sid, event_id))

    refusal = LandlockRefusal(
        "sbx-a", "write", ("fs.write_file",), "/workspace/scratch/x", 4242, "1fe"
    )
    outlet = EventOutlet(publish, RefusalGate())
    await outlet.start()
    await NodeAgent._landlock_refused(SimpleNamespace(outlet=outlet), refusal)  # type: ignore[arg-type]
    await outlet.stop()
    [(payload, sid, event_id)] = published
    assert isinstance(payload, events.PolicyViolation)
    assert (sid, event_id) == ("sbx-a", None)
    assert payload.model_dump(include={"layer", "rule_id", "action", "operation", "target"}) == {
        "layer": "kernel",
        "rule_id": "landlock",
        "action": "deny",
        "operation": "write",
        "target": "/workspace/scratch/x",
    }
    assert payload.message == (
        "Landlock refused write of /workspace/scratch/x (pid 4242; blocked right fs.write_file) "
        "with EACCES: the path is outside the spec's write_allowed"
    )


# ----------------------------------------------------------------------------- several node agents

HOLDER = """
import sys, time
from dsec_nodeagent.sandbox import audit
audit._SWITCH.acquire()
print("holding", flush=True)
sys.stdin.readline()  # until told (or killed)
audit._SWITCH.release()
print("released", flush=True)
"""


def _other_readers() -> set[str]:
    """Readers of this host other than this test's processes (node agents of other stacks)."""
    readers = audit.HOST_DIR / "readers"
    return {p.name for p in readers.iterdir()} if readers.is_dir() else set()


async def test_the_domain_table_stays_bounded_when_a_sandbox_makes_domains_without_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandbox may make Landlock domains in a loop, and their "deallocated" records can be
    lost in a flood: the reader remembers at most MAX_DOMAINS of them (the most recent), and
    none of other processes' domains."""
    monkeypatch.setattr(audit, "MAX_DOMAINS", 8)
    seen: list[LandlockRefusal] = []

    async def handler(refusal: LandlockRefusal) -> None:
        seen.append(refusal)

    reader = audit.LandlockAudit(lambda pid, uid: "sbx-a" if uid == 65001 else None, handler)
    for serial in range(1, 41):
        record = ALLOCATED.format(serial=serial).replace("domain=1fe", f"domain={serial:x}")
        if serial % 2:  # every other one of a process of no sandbox here
            record = record.replace("uid=65001", "uid=0")
        reader.add_record(audit.AUDIT_LANDLOCK_DOMAIN, record)
        reader.add_record(audit.AUDIT_EOE, f"audit(1796009056.066:{serial}): ")
    await reader.close()
    assert len(reader._domains) == 8
    assert set(reader._domains.values()) == {"sbx-a"}


@pytest.mark.kernel
def test_one_node_agent_stopping_leaves_audit_on_for_another_of_the_host() -> None:
    import signal
    import subprocess

    before = _state_to_come_back_to()
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for holder in holders:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        assert _audit_status().enabled in (1, 2)
        assert {str(h.pid) for h in holders} <= _other_readers()
        first, second = holders
        assert first.stdin is not None
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.stdout is not None and first.stdout.readline().strip() == "released"
        assert _audit_status().enabled in (1, 2)  # the second node agent still reads
        second.send_signal(signal.SIGKILL)  # it dies without releasing
        second.wait(10)
        # A reader that starts and stops now finds the dead one's entry stale: it restores.
        audit._SWITCH.acquire()
        audit._SWITCH.release()
        assert str(second.pid) not in _other_readers()
        if not _other_readers():  # no node agent of another stack reads on this host now
            assert _audit_status().enabled == before.enabled
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(10)


_FLOODER = """
import os, time, json
end = time.monotonic() + 6
for _ in range(3):
    if os.fork() == 0:
        break
n = 0
while time.monotonic() < end:
    try:
        os.open("/workspace/private/f.txt", os.O_RDONLY)
    except PermissionError:
        n += 1
print(json.dumps({"denials": n}), flush=True)
"""
_VICTIM = """
import json, time
seen = []
for i in range(10):
    try:
        open(f"/workspace/private/victim{i}.txt").read()
        seen.append("ok")
    except PermissionError:
        seen.append("EACCES")
    time.sleep(0.3)
print(json.dumps(seen))
"""


async def test_a_sandbox_flooding_landlock_refusals_hides_no_neighbours_refusals(
    tmp_path: Path,
) -> None:
    """Every sandbox's Landlock records go through one kernel audit queue and one reader with
    a budget. Before (found by an adversarial review, 2026-12-07), four processes looping on a
    refused ``open`` (~100,000 a second) overflowed them: a neighbour's refusals made meanwhile
    went unreported (1 to 3 of 10), and kauditd spent ~25 % of a core. Now a sandbox past 200
    refusals a second has its records dropped in the kernel for a while (an audit exclude rule
    on its uid, taken back when the quiet ends or the sandbox does), and says so in one
    refusal; the neighbour's 10 refusals are all reported."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "f.txt").write_text("x")
    for i in range(10):
        (private / f"victim{i}.txt").write_text("x")
    mounts = [Mount(source=private, target="/workspace/private")]
    seen: list[LandlockRefusal] = []

    async def on_landlock_refusal(refusal: LandlockRefusal) -> None:
        seen.append(refusal)

    async with managed(tmp_path / "home", on_landlock_refusal=on_landlock_refusal) as manager:
        await manager.launch(snippet_config("flood", _FLOODER, tmp_path, mounts=mounts))
        await asyncio.sleep(1.0)
        victim = await run_to_end(
            manager, snippet_config("victim", _VICTIM, tmp_path, mounts=mounts)
        )
        flooder = await asyncio.wait_for(manager.wait("flood"), 60)
        await asyncio.sleep(0.5)  # (the last records read)
    assert read_json_output(victim) == ["EACCES"] * 10
    denials = sum(
        json.loads(line)["denials"] for line in Path(flooder.stdout_path).read_text().splitlines()
    )
    assert denials > 10_000, denials  # (a flood: the kernel refused each)
    reported = sorted(r.target for r in seen if r.sandbox_id == "victim")
    assert reported == sorted(f"/workspace/private/victim{i}.txt" for i in range(10)), reported
    hushed = [r for r in seen if r.sandbox_id == "flood" and r.quiet_s > 0]
    assert hushed and "dropped in the kernel" in audit.describe(hushed[0])
    flood_reported = sum(1 for r in seen if r.sandbox_id == "flood")
    assert flood_reported < denials / 10, (flood_reported, denials)
    # no exclude rule outlives the sandbox (nor the reader)
    assert not any((audit.HOST_DIR / "quiet").glob("*"))


def test_exclude_rules_a_dead_node_agent_left_are_deleted_by_the_next(tmp_path: Path) -> None:
    """A node agent that crashed while a sandbox was hushed left its exclude rule: the uid's
    next sandbox would go unheard. The next reader to start deletes the rules of processes that
    are gone (and keeps a live one's)."""
    rules = audit._QuietRules(tmp_path)
    gone, live = 61_001, 61_002
    rules.add(gone)
    rules.add(live)
    (rules.dir / str(gone)).write_text("999999999 0")  # (its process is gone)
    try:
        rules.sweep()
        assert sorted(p.name for p in rules.dir.iterdir()) == [str(live)]
        with pytest.raises(OSError):  # the kernel has no such rule any more
            audit._change_rule(audit.AUDIT_DEL_RULE, gone)
    finally:
        rules.delete(live)
    assert not any(rules.dir.iterdir())


_SCOPED = 'audit(1796009056.066:{s}): domain=1fe blockers=scope.signal opid=1 ocomm="x"'
_SYSCALL_OF = (
    "audit(1796009056.066:{s}): arch=c000003e syscall=1 success=yes exit=1 a0=1 "
    'ppid=1 pid={pid} auid=4294967295 uid={uid} gid={uid} euid={uid} comm="w" exe="/w"'
)


async def test_a_flood_hushes_its_own_sandboxs_uid_never_a_neighbours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A denial can be raised in another task's context (a scoped signal: the refusing domain
    is sandbox A's, the task doing the I/O neighbour B's): the uid its SYSCALL record names is
    B's. Hushing by that uid would have deafened B (found in review, 2026-12-07). A sandbox is
    hushed under its own uid only."""
    added: list[int] = []
    monkeypatch.setattr(audit._QUIET, "add", added.append)
    monkeypatch.setattr(audit._QUIET, "delete", lambda uid: None)
    owners = {65001: "sbx-a", 65002: "sbx-b"}
    reader = audit.LandlockAudit(lambda pid, uid: owners.get(uid), None)
    reader._loop = asyncio.get_running_loop()

    def event(serial: int, uid: int) -> None:
        reader.add_record(audit.AUDIT_LANDLOCK_ACCESS, _SCOPED.format(s=serial))
        if serial == 1:
            reader.add_record(
                audit.AUDIT_LANDLOCK_DOMAIN, ALLOCATED.replace("{serial}", str(serial))
            )
        reader.add_record(audit.AUDIT_SYSCALL, _SYSCALL_OF.format(s=serial, pid=4242, uid=uid))
        reader.add_record(audit.AUDIT_EOE, f"audit(1796009056.066:{serial}): ")

    reader._remember("1fe", "sbx-a")
    try:
        for serial in range(1, 201):  # A's own: 200 in this second
            event(serial, 65001)
        event(201, 65002)  # A's domain, raised in B's task
        assert added == []
        event(202, 65001)  # A's own again, past the rate
        assert added == [65001]
    finally:
        for handle, _ in reader._quiet.values():
            handle.cancel()
