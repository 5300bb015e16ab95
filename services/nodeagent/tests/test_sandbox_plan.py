"""Pure parts of the sandbox: layout and Landlock sets, exit reasons, uids, the seccomp program."""

from __future__ import annotations

import re
import struct
from pathlib import Path, PurePosixPath

import pytest
from pydantic import SecretStr, ValidationError

from dsec_nodeagent.sandbox import ExitReason, Mount, SandboxConfig, domain, plan, seccomp
from dsec_nodeagent.sandbox.discovery import RuntimeView, resolve_chain

pytestmark = pytest.mark.unit

VIEW = RuntimeView(
    executable="/opt/py/bin/python3.11",
    version="3.11",
    ro_dirs=["/opt/py", "/usr/lib/x86_64-linux-gnu"],
    ro_files=[],
    symlinks=[("/lib64", "usr/lib64")],
)
FACTS = plan.KernelFacts(
    landlock_abi=7, cap_last_cap=40, seccomp_program=b"\0" * 8, cgroup_procs=[]
)


def _host(tmp: Path) -> plan.HostPaths:
    return plan.HostPaths(
        root=tmp / "root", exit_path=tmp / "exit.json", data_dir=tmp / "data", semantic_site=tmp
    )


def _config(tmp: Path, **fields: object) -> SandboxConfig:
    base: dict[str, object] = {
        "sandbox_id": "s1",
        "argv": ["python", "-c", "1"],
        "runtime": Path("/opt/py/bin/python3.11"),
    }
    base.update(fields)
    return SandboxConfig.model_validate(base)


def test_layout_has_runtime_workdir_mounts_and_private_tmp(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    result = plan.build(
        _config(
            tmp_path,
            mounts=[Mount(source=data, target="/workspace/data")],
            read_allowed=["/workspace/data"],
            write_allowed=["/tmp", "/workspace/out"],
        ),
        VIEW,
        _host(tmp_path),
        FACTS,
        uid=200001,
    )
    kinds = {(e["kind"], e["path"]) for e in result.plan["layout"]}
    assert {
        ("bind", "/opt/py"),
        ("symlink", "/lib64"),
        ("tmpfs", "/tmp"),
        ("bind", "/workspace/data"),
        ("bind", "/workspace/out"),
        ("proc", "/proc"),
        ("dev", "/dev"),
        ("dir", "/workspace/code"),
    } <= kinds
    assert result.writable_dirs == [tmp_path / "data" / "fs" / "workspace__out"]
    assert result.plan["argv"] == ["/opt/py/bin/python3.11", "-c", "1"]
    assert "/workspace/data" in result.plan["landlock"]["read"]
    assert "/workspace/out" in result.plan["landlock"]["write"]
    assert result.warnings == []


def test_a_mount_nobody_may_read_is_warned_about(tmp_path: Path) -> None:
    result = plan.build(
        _config(tmp_path, mounts=[Mount(source=tmp_path, target="/data")]),
        VIEW,
        _host(tmp_path),
        FACTS,
        uid=1,
    )
    assert result.warnings == ["mount /data is not under read_allowed: the sandbox cannot read it"]


def test_no_read_allowed_path_binds_the_nodes_home_or_shared_dirs_even_through_a_link(
    tmp_path: Path,
) -> None:
    """The org's rules (the policy service) decide which host paths a spec may read; the node
    holds its own line whatever they allow: its home (every sandbox's code, logs and keys)
    and the host's shared directories are never bound, nor is a path whose symlinks lead
    there, nor a parent of one, nor the host's whole file system."""
    home = tmp_path / "home"
    (home / "sandboxes" / "other" / "code").mkdir(parents=True)
    link = tmp_path / "innocent"
    link.symlink_to(home / "sandboxes")
    public = tmp_path / "public"
    public.mkdir()
    denied = [home, Path("/run")]
    for path, why in (
        (str(home / "sandboxes" / "other"), f"host's {home}"),
        (str(link), f"(resolved: {home / 'sandboxes'})"),
        (str(tmp_path), f"host's {home}"),  # a parent of the home
        ("/run", "host's /run"),
        ("/", "the host's whole file system"),
    ):
        config = _config(tmp_path, read_allowed=[path], host_denied=denied, write_allowed=[])
        with pytest.raises(plan.PlanError, match=re.escape(why)):
            plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1)
    config = _config(tmp_path, read_allowed=[str(public)], host_denied=denied, write_allowed=[])
    binds = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1).plan["layout"]
    assert {"kind": "bind", "src": str(public), "path": str(public), "ro": True} in binds


def test_resolv_conf_kept_under_run_by_the_hosts_resolver_is_still_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a systemd-resolved host /etc/resolv.conf leads to /run/systemd/resolve/: that one
    public file is shown though /run never is (its neighbours stay refused)."""
    run = tmp_path / "run"
    (run / "systemd" / "resolve").mkdir(parents=True)
    stub = run / "systemd" / "resolve" / "stub-resolv.conf"
    stub.write_text("nameserver 127.0.0.53\n")
    (run / "secret.sock").write_text("x")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "resolv.conf").symlink_to(stub)
    monkeypatch.setattr(plan, "PUBLIC_RUNTIME_FILES", frozenset({str(stub)}))
    config = _config(
        tmp_path, read_allowed=[str(etc / "resolv.conf")], host_denied=[run], write_allowed=[]
    )
    layout = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1).plan["layout"]
    assert any(e.get("path") == str(etc / "resolv.conf") for e in layout)
    config = _config(
        tmp_path, read_allowed=[str(run / "secret.sock")], host_denied=[run], write_allowed=[]
    )
    with pytest.raises(plan.PlanError, match="never binds"):
        plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1)


def test_nothing_under_a_workdir_without_code_comes_from_the_host(tmp_path: Path) -> None:
    """Before, a workdir with no code was an empty directory, and a read_allowed path under
    it was bound from the host (with workdir /, every one: the host's /etc)."""
    (tmp_path / "w" / "etc").mkdir(parents=True)
    config = _config(
        tmp_path,
        workdir=str(tmp_path / "w"),
        read_allowed=[str(tmp_path / "w" / "etc")],
        write_allowed=[],
    )
    layout = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1).plan["layout"]
    assert not any(e.get("src") == str(tmp_path / "w" / "etc") for e in layout)


def test_a_private_tmp_holds_at_most_the_sandboxs_memory(tmp_path: Path) -> None:
    """Before, /tmp was a tmpfs of the host's default size (half its RAM, and an inode per page
    of that): a sandbox filled it past its own memory limit with files the memory cgroup may
    not account."""
    from dsec_nodeagent.sandbox import Limits

    config = _config(tmp_path, write_allowed=["/tmp"], limits=Limits(memory_bytes=512 * 2**20))
    layout = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1).plan["layout"]
    (tmp,) = [e for e in layout if e["kind"] == "tmpfs" and e["path"] == "/tmp"]
    assert tmp["options"] == f"mode=1777,size={512 * 2**20},nr_inodes=32768"
    assert plan.tmp_options(None) == "mode=1777"


def test_a_read_allowed_path_that_exists_nowhere_is_warned_about_the_workdir_is_not(
    tmp_path: Path,
) -> None:
    missing = "/nonexistent-dsec-plan-test/data"
    result = plan.build(
        # no code bundle: the workdir is an empty directory of the view, there all the same
        _config(tmp_path, workdir="/workspace", read_allowed=["/workspace", missing]),
        VIEW,
        _host(tmp_path),
        FACTS,
        uid=1,
    )
    assert result.warnings == [f"read_allowed {missing} exists neither in a mount nor on the host"]


def _two_mounts(tmp_path: Path, first: str, second: str) -> SandboxConfig:
    """A config mounting one source directory at two targets."""
    (tmp_path / "a").mkdir(exist_ok=True)
    mounts = [Mount(source=tmp_path / "a", target=t) for t in (first, second)]
    return _config(tmp_path, mounts=mounts)


def test_a_mount_inside_another_is_refused_naming_both(tmp_path: Path) -> None:
    config = _two_mounts(tmp_path, "/w", "/w/x/y")
    with pytest.raises(plan.PlanError, match="/w/x/y lies inside the mount at /w"):
        plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1)


def test_the_overlap_check_tells_a_parent_directory_from_a_name_prefix(tmp_path: Path) -> None:
    built = plan.build(_two_mounts(tmp_path, "/w", "/wide/x"), VIEW, _host(tmp_path), FACTS, 1)
    layout = built.plan["layout"]
    assert {"/w", "/wide/x"} <= {e["path"] for e in layout}
    depths = [len(PurePosixPath(e["path"]).parts) for e in layout]
    assert depths == sorted(depths)  # parents are made before what lies in them
    deep = _two_mounts(tmp_path, "/w/x", "/w/x/y/z")
    with pytest.raises(plan.PlanError, match="/w/x/y/z lies inside the mount at /w/x;"):
        plan.build(deep, VIEW, _host(tmp_path), FACTS, uid=1)


def test_missing_mount_source_names_the_mount(tmp_path: Path) -> None:
    config = _config(tmp_path, mounts=[Mount(source=tmp_path / "nope", target="/w")])
    with pytest.raises(plan.PlanError, match=r"mount /w: source .*nope does not exist"):
        plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1)


def test_secrets_reach_the_workload_env_only(tmp_path: Path) -> None:
    config = _config(tmp_path, secret_env={"API_KEY": SecretStr("v4lue")})
    result = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1)
    assert result.plan["env"]["API_KEY"] == "v4lue"
    assert "v4lue" not in repr(config)


def test_a_spec_cannot_move_or_switch_off_the_user_site(tmp_path: Path) -> None:
    # usercustomize adds the environment's packages and the semantic layer: the sandbox's
    # Python must load it whatever the spec's env says, and the spec hears why.
    config = _config(
        tmp_path, env={"PYTHONUSERBASE": "/tmp/mine", "PYTHONNOUSERSITE": "1", "A": "b"}
    )
    result = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1)
    env = result.plan["env"]
    assert env["PYTHONUSERBASE"] == "/opt/dsec/user"
    assert "PYTHONNOUSERSITE" not in env
    assert env["A"] == "b"
    assert [w.split(":")[0] for w in result.warnings if "user site" in w] == [
        "env PYTHONUSERBASE",
        "env PYTHONNOUSERSITE",
    ]
    site = {e["path"]: e for e in result.plan["layout"]}[plan.user_site(VIEW.version)]
    assert site == {"kind": "symlink", "path": site["path"], "target": plan.SEMANTIC_TARGET}


def test_only_a_checkpointable_sandbox_gives_up_the_abstract_socket_scope(tmp_path: Path) -> None:
    """Migration path criu (docs/migration.md): opt-in, and what it costs is named in the plan."""
    default = plan.build(_config(tmp_path), VIEW, _host(tmp_path), FACTS, uid=1).plan
    assert default["landlock"]["scope_abstract_unix"] is True and not default["reaper_exec"]
    config = _config(tmp_path, checkpointable=True)
    movable = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=1).plan
    assert movable["landlock"]["scope_abstract_unix"] is False and movable["reaper_exec"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sandbox_id": "../x"}, "sandbox_id"),
        ({"workdir": "relative"}, "must be an absolute path"),
        ({"write_allowed": ["/proc/x"]}, "/proc is reserved"),
        ({"env": {"K": "1"}, "secret_env": {"K": "2"}}, "both as plain env and as a secret"),
    ],
)
def test_bad_config_is_refused_naming_the_field(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        _config(tmp_path, **fields)


@pytest.mark.parametrize(
    ("requested", "code", "sig", "oom", "pids", "reason"),
    [
        (None, 0, None, 0, 0, ExitReason.OK),
        (None, 1, None, 0, 0, ExitReason.ERROR),
        (None, 137, 9, 1, 0, ExitReason.OOM),
        (None, 1, None, 0, 5, ExitReason.PIDS),
        (None, 0, None, 0, 5, ExitReason.OK),
        (None, 159, 31, 0, 0, ExitReason.POLICY),
        (ExitReason.TIMEOUT, 137, 9, 0, 0, ExitReason.TIMEOUT),
        (ExitReason.STOPPED, 143, 15, 1, 0, ExitReason.STOPPED),
        (None, None, None, 0, 0, ExitReason.ERROR),
    ],
)
def test_exit_reason(
    requested: ExitReason | None,
    code: int | None,
    sig: int | None,
    oom: int,
    pids: int,
    reason: ExitReason,
) -> None:
    assert domain.classify_exit(requested, code, sig, oom, pids)[0] is reason


def test_uids_are_per_sandbox_and_skip_those_in_use() -> None:
    first = domain.allocate_uid("a", set())
    assert domain.UID_BASE <= first < domain.UID_BASE + domain.UID_COUNT
    assert domain.allocate_uid("a", {first}) != first


def test_seccomp_program_checks_arch_first_and_ends_in_returns() -> None:
    program = seccomp.build_filter()
    assert len(program) % 8 == 0
    first = struct.unpack("<HBBI", program[:8])
    assert first == (0x20, 0, 0, 4)  # load seccomp_data.arch
    codes = [struct.unpack("<HBBI", program[i : i + 8])[0] for i in range(0, len(program), 8)]
    assert codes[-1] == 0x06  # every path ends in a return


def test_symlink_chains_are_resolved_component_by_component(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "lib.so").write_text("")
    (tmp_path / "alias").symlink_to("real")
    real, links = resolve_chain(str(tmp_path / "alias" / "lib.so"))
    assert real == str(tmp_path / "real" / "lib.so")
    assert links == [(str(tmp_path / "alias"), "real")]


def test_stage_timings_are_in_layer_order() -> None:
    t0 = 0
    marks = {"plan": 1_000_000, "cgroup": 2_000_000, "spawn_start": 2_000_000}
    records = [
        {"stage": "spawn", "end_ns": 12_000_000},
        {"stage": "mounts", "start_ns": 13_000_000, "end_ns": 15_000_000},
        {"stage": "exec", "start_ns": 16_000_000},
    ]
    timings = domain.stage_timings(t0, marks, records, ready_ns=17_000_000)
    assert list(timings) == ["plan", "cgroup", "spawn", "mounts", "exec"]
    assert timings == {"plan": 1.0, "cgroup": 1.0, "spawn": 10.0, "mounts": 2.0, "exec": 1.0}


def test_a_hook_run_after_the_hand_over_counts_with_the_hosts_preparation() -> None:
    # plan ends at 1 ms; the host prepares (the cgroups too) until the hand-over at 1.5 ms;
    # the hook on the cgroups (egress programs) runs from 2 to 2.5 ms while init binds:
    # "cgroup" is 0.5 + 0.5 ms, not the span 1 to 2.5 ms.
    marks = {"plan": 1_000_000, "spawn_start": 1_500_000, "cgroup_start": 2_000_000}
    marks["cgroup"] = 2_500_000
    records = [{"stage": "spawn", "end_ns": 3_000_000}]
    timings = domain.stage_timings(0, marks, records, ready_ns=9_000_000)
    assert timings == {"plan": 1.0, "cgroup": 1.0, "spawn": 1.5}


def test_named_cgroups_are_the_ones_made(tmp_path: Path) -> None:
    from dsec_nodeagent.sandbox import cgroups

    hierarchy = cgroups.Hierarchy(
        tmp_path / "unified", frozenset({"pids"}), {"memory": tmp_path / "v1-memory"}
    )
    planned = cgroups.SandboxCgroup.planned(hierarchy, "sb-1", node="node-7")
    assert planned.v2_dir == tmp_path / "unified" / "dsec" / "node-7" / "sb-1"
    assert planned.dirs == {
        "memory": tmp_path / "v1-memory" / "dsec" / "node-7" / "sb-1",
        "pids": planned.v2_dir,
    }
    assert planned.procs_files() == [
        str(planned.v2_dir / "cgroup.procs"),
        str(tmp_path / "v1-memory" / "dsec" / "node-7" / "sb-1" / "cgroup.procs"),
    ]
    assert not planned.v2_dir.exists()  # named only


def test_restart_backoff_doubles_from_200ms_up_to_5s() -> None:
    from dsec_nodeagent.agent import restart_backoff_s

    assert [restart_backoff_s(n) for n in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


def test_a_gpu_unit_sees_only_its_device_nodes_and_mps_pipe(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    config = _config(
        tmp_path,
        gpu_devices=["nvidiactl", "nvidia-uvm", "nvidia3"],
        gpu_binds={"/run/dsec/mps/GPU-3": pipe},
    )
    result = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=200001)
    dev = next(e for e in result.plan["layout"] if e["kind"] == "dev")
    assert dev["nodes"] == [*plan.DEV_NODES, "nvidiactl", "nvidia-uvm", "nvidia3"]
    binds = {e["path"]: e for e in result.plan["layout"] if e["kind"] == "bind"}
    assert binds["/run/dsec/mps/GPU-3"] == {
        "kind": "bind", "src": str(pipe), "path": "/run/dsec/mps/GPU-3", "ro": False,
    }  # fmt: skip
    write = result.plan["landlock"]["write"]
    assert {"/dev/nvidia3", "/dev/nvidiactl", "/run/dsec/mps/GPU-3"} <= set(write)
    plain = plan.build(_config(tmp_path), VIEW, _host(tmp_path), FACTS, uid=200001)
    plain_dev = next(e for e in plain.plan["layout"] if e["kind"] == "dev")
    assert plain_dev["nodes"] == list(plan.DEV_NODES)  # no GPU granted: no NVIDIA node at all


@pytest.mark.parametrize(
    ("writes", "mount_writable", "sources", "disk"),
    [
        (["/tmp"], False, {}, 64 * 2**20),  # /tmp is a tmpfs: no quota filesystem
        (["/tmp", "/workspace/out"], False, {}, 64 * 2**20),
        (["/workspace/data/out"], True, {}, 64 * 2**20),  # inside a writable mount
        (["/workspace/out"], False, {"/workspace/out": "src"}, 64 * 2**20),  # placed elsewhere
        (["/workspace/out"], False, {}, None),  # no quota asked for
    ],
)
def test_the_quota_taken_before_the_plan_is_the_one_the_plan_lays_out(
    tmp_path: Path,
    writes: list[str],
    mount_writable: bool,
    sources: dict[str, str],
    disk: int | None,
) -> None:
    """The manager takes a pooled quota image before it plans (init copies the mount tree at
    its fork): ``needs_disk_quota`` must agree with the writable directories the plan puts on
    the quota filesystem."""
    data = tmp_path / "d"
    data.mkdir()
    config = _config(
        tmp_path,
        mounts=[Mount(source=data, target="/workspace/data", read_only=not mount_writable)],
        write_allowed=writes,
        write_sources={k: tmp_path / v for k, v in sources.items()},
        limits={"disk_bytes": disk},
    )
    built = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=200001)
    on_quota = any(d.is_relative_to(tmp_path / "data" / "fs") for d in built.writable_dirs)
    assert plan.needs_disk_quota(config) is (on_quota and disk is not None)
    assert plan.needs_disk_quota(config) is (
        writes[-1] == "/workspace/out" and not sources and disk is not None
    )


def test_the_state_files_uids_are_read_once_and_follow_writes_removals_and_other_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node agent checks which uids its state files name at every sandbox start: each file is
    read once (the store writes them), not once per start."""
    from dsec_nodeagent.sandbox.state import StateStore

    store = StateStore(tmp_path / "state")
    assert store.uids() == set()
    for n in range(50):
        store.write(f"sbx-{n}", {"sandbox_id": f"sbx-{n}", "uid": 200_000 + n})
    store.write("sbx-starting", {"sandbox_id": "sbx-starting", "phase": "starting"})
    StateStore(tmp_path / "state").write("sbx-left", {"uid": 300_000})  # an earlier agent's
    reads: list[str] = []
    real = StateStore.read
    monkeypatch.setattr(StateStore, "read", lambda self, sid: reads.append(sid) or real(self, sid))
    expected = {200_000 + n for n in range(50)} | {300_000}
    assert store.uids() == expected
    assert reads == ["sbx-left"]  # the one file it did not write
    reads.clear()
    store.write("sbx-starting", {"sandbox_id": "sbx-starting", "uid": 250_000})
    store.remove("sbx-3")
    (tmp_path / "state" / "sbx-4.json").unlink()  # removed by another (a cleanup)
    for _ in range(3):
        assert store.uids() == (expected - {200_003, 200_004}) | {250_000}
    assert reads == []


def test_a_plans_shared_entries_are_the_runtime_and_the_semantic_site_only(tmp_path: Path) -> None:
    code, extra = tmp_path / "code", tmp_path / "extra"
    code.mkdir()
    extra.mkdir()
    config = _config(
        tmp_path, code_dir=code, extra_ro_paths=[extra], write_allowed=["/workspace/out"]
    )
    built = plan.build(config, VIEW, _host(tmp_path), FACTS, uid=200001).plan
    shared = [built["layout"][index] for index in built["shared"]]
    assert {(e["kind"], e["path"]) for e in shared} == {
        ("symlink", "/lib64"),
        ("bind", "/opt/py"),
        ("bind", "/usr/lib/x86_64-linux-gnu"),
        ("bind", plan.SEMANTIC_TARGET),
        ("symlink", plan.user_site("3.11")),
    }
    assert built["shared"] == sorted(built["shared"])  # in the layout's (depth) order
    # another sandbox of the same runtime shares exactly those, whatever else differs
    other = plan.build(
        _config(tmp_path, sandbox_id="s2", network=True), VIEW, _host(tmp_path), FACTS, uid=200002
    ).plan
    assert [other["layout"][index] for index in other["shared"]] == shared


def _prebound_plan(*entries: dict[str, object], shared: list[int]) -> dict[str, object]:
    return {"layout": list(entries), "shared": shared}


def test_the_mount_word_init_reads_carries_what_init_takes_and_no_more() -> None:
    """The node agent's side (zygote.py) writes the word init's side reads, with their
    constants kept by hand in two modules: shared entries within init's bound go with it, more
    than that do not (init would refuse them and fail the launch)."""
    import marshal
    import os

    from dsec_nodeagent.sandbox import init, zygote

    assert (zygote.MOUNT_NOW, zygote.MOUNT_SHARED, zygote.SHARED_MAX) == (
        init.MOUNT_NOW,
        init.MOUNT_SHARED,
        init.SHARED_MAX,
    )
    entries = [{"kind": "bind", "src": "/opt/py", "path": "/opt/py", "ro": True}]
    word = zygote.mount_word(marshal.dumps(entries))
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, word)
        assert os.read(read_fd, 1) == init.MOUNT_SHARED
        size = int.from_bytes(init._read_exact(read_fd, 4), "big")
        assert marshal.loads(init._read_exact(read_fd, size)) == entries
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert zygote.mount_word(b"") == init.MOUNT_NOW
    assert zygote.mount_word(b"x" * (init.SHARED_MAX + 1)) == init.MOUNT_NOW


def test_entries_bound_ahead_are_kept_only_where_the_plan_shares_exactly_them() -> None:
    from dsec_nodeagent.sandbox import init

    runtime = {"kind": "bind", "src": "/opt/py", "path": "/opt/py", "ro": True}
    link = {"kind": "symlink", "path": "/lib64", "target": "usr/lib64"}
    code = {"kind": "bind", "src": "/srv/code", "path": "/workspace/code", "ro": True}
    kept = init._prebound_kept
    assert kept(_prebound_plan(link, runtime, code, shared=[0, 1]), [link, runtime]) == {0, 1}
    assert kept(_prebound_plan(link, runtime, code, shared=[0, 1]), []) is None
    # another runtime, another order, fewer or more: none is kept
    other = {**runtime, "src": "/opt/py2"}
    assert kept(_prebound_plan(link, other, code, shared=[0, 1]), [link, runtime]) is None
    assert kept(_prebound_plan(runtime, link, code, shared=[0, 1]), [link, runtime]) is None
    assert kept(_prebound_plan(link, runtime, code, shared=[1]), [link, runtime]) is None
    assert kept(_prebound_plan(link, runtime, shared=[0, 1, 5]), [link, runtime]) is None
    # a plan's own entry above or at a shared one would have been bound before it: none kept
    above = {"kind": "bind", "src": "/srv/opt", "path": "/opt", "ro": True}
    assert kept(_prebound_plan(above, runtime, shared=[1]), [runtime]) is None
    at = {"kind": "tmpfs", "path": "/opt/py", "options": "mode=755"}
    assert kept(_prebound_plan(runtime, at, shared=[0]), [runtime]) is None
    # a name that only starts like a shared path is not above it
    beside = {"kind": "bind", "src": "/srv/x", "path": "/opt/python", "ro": True}
    assert kept(_prebound_plan(runtime, beside, shared=[0]), [runtime]) == {0}


def test_entries_bound_ahead_are_compared_by_their_names_not_their_spelling() -> None:
    from dsec_nodeagent.sandbox import init

    runtime = {"kind": "bind", "src": "/opt/py", "path": "/opt/py", "ro": True}
    for above in ("//opt", "/opt/", "/./opt", "//opt/py", "/"):
        entry = {"kind": "bind", "src": "/srv/x", "path": above, "ro": True}
        assert init._prebound_kept({"layout": [entry, runtime], "shared": [1]}, [runtime]) is None


def test_a_path_with_a_doubled_leading_slash_is_the_path(tmp_path: Path) -> None:
    config = _config(tmp_path, workdir="//workspace/code", write_allowed=["//tmp"])
    assert config.workdir == "/workspace/code"
    assert config.write_allowed == ["/tmp"]


@pytest.mark.parametrize(
    "fields",
    [
        {"mounts": [{"source": "SRC", "target": "RT/bin"}]},
        {"mounts": [{"source": "SRC", "target": "RT/bin/python3.11"}]},
        {"workdir": "RT/lib/code", "code_dir": "SRC"},
        {"write_allowed": ["RT/lib/python3.11"]},
        {"mounts": [{"source": "RT/lib/code", "target": "RT/bin"}]},
    ],
)
def test_nothing_a_spec_declares_may_replace_what_the_node_provides(
    tmp_path: Path, fields: dict[str, object]
) -> None:
    # A checkpointable sandbox's init (root, every capability) runs the runtime's interpreter
    # from the sandbox's view: a spec's mount over its bin directory ran the tenant's file as
    # root. What lies inside the runtime's directories (and the semantic layer, the node's
    # sockets) is the node's.
    runtime = tmp_path / "rt"
    for name in ("bin/python3.11", "lib/code/x", "lib/python3.11/os.py"):
        (runtime / name).parent.mkdir(parents=True, exist_ok=True)
        (runtime / name).write_text("")
    src = tmp_path / "src"
    src.mkdir()
    (src / "python3.11").write_text("#!/bin/sh\n")
    view = RuntimeView(
        executable=f"{runtime}/bin/python3.11",
        version="3.11",
        ro_dirs=[str(runtime)],
        ro_files=[],
        symlinks=[],
    )

    def given(value: object) -> object:
        if isinstance(value, list):
            return [given(v) for v in value]
        if isinstance(value, dict):
            return {k: given(v) for k, v in value.items()}
        if value == "SRC":
            return src
        if isinstance(value, str) and value.startswith("RT/"):
            return value.replace("RT", str(runtime))
        return value

    # (no /tmp tmpfs: the test's runtime lies under the host's /tmp)
    config = _config(
        tmp_path,
        runtime=Path(view.executable),
        **{"write_allowed": [], **{k: given(v) for k, v in fields.items()}},
    )
    with pytest.raises(plan.PlanError, match="which the node provides"):
        plan.build(config, view, _host(tmp_path), FACTS, uid=200001)
    # beside the runtime, the same declarations are laid out
    beside = {k: given(v) for k, v in fields.items()}
    moved = {
        k: (
            [{**m, "target": "/workspace/data"} for m in v]
            if k == "mounts"
            else ["/workspace/data"]
            if isinstance(v, list)
            else "/workspace/data"
            if k == "workdir"
            else v
        )
        for k, v in beside.items()
    }
    plan.build(
        _config(tmp_path, runtime=Path(view.executable), **{"write_allowed": [], **moved}),
        view,
        _host(tmp_path),
        FACTS,
        uid=200001,
    )
    # the host's own file shown read-only at its own path (read_allowed) is what the node
    # shows there already: laid out
    readable = _config(
        tmp_path,
        runtime=Path(view.executable),
        write_allowed=[],
        read_allowed=[f"{runtime}/lib/python3.11/os.py"],
    )
    plan.build(readable, view, _host(tmp_path), FACTS, uid=200001)


def test_a_host_path_shown_at_its_own_path_may_not_cover_a_node_directory_shown_elsewhere(
    tmp_path: Path,
) -> None:
    # The exemption for read_allowed (the host's file at its own path) holds inside the
    # runtime's own directories only; inside a node directory shown at another path (an MPS
    # pipe directory, the semantic site) the host's file would replace the node's.
    shown = tmp_path / "mps-src"
    (shown / "sub").mkdir(parents=True)
    (shown / "sub" / "control").write_text("the node's")
    target = tmp_path / "mps"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "control").write_text("the host's")
    config = _config(
        tmp_path,
        write_allowed=[],
        gpu_binds={str(target): shown},
        read_allowed=[str(target / "sub" / "control")],
    )
    with pytest.raises(plan.PlanError, match="which the node provides"):
        plan.build(config, VIEW, _host(tmp_path), FACTS, uid=200001)


def test_launches_discovering_one_runtime_at_once_all_get_its_view(tmp_path: Path) -> None:
    """A node's launches run at once, each discovering its runtime in a thread: on a cold
    cache they all write its entry, each through a temporary file of its own (before, they
    shared one, and a launch's rename failed: 'No such file or directory')."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from dsec_nodeagent.sandbox.discovery import discover_cached

    for n in range(8):  # (the rename race needs the writes to meet)
        cache = tmp_path / f"runtimes-{n}"
        with ThreadPoolExecutor(6) as pool:
            views = list(
                pool.map(lambda _, c=cache: discover_cached(Path(sys.executable), [], c), range(6))
            )
        assert len({view.executable for view in views}) == 1
        assert [p.suffix for p in cache.iterdir()] == [".json"]  # no temporary file left
