"""GPU slicing, device fencing and the memory quota watch: pure decisions with a fake NVML,
and the device cgroup program on this machine's kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dsec_nodeagent.gpuenforce import attach_device_guard, device_program
from dsec_nodeagent.gpuquota import QuotaWatch, usage_of
from dsec_nodeagent.gpuslice import (
    DeviceInfo,
    DeviceRule,
    MigProfile,
    ProcessUsage,
    SliceError,
    SliceSettings,
    device_rules,
    nvidia_majors,
    plan_slice,
    with_mig_instance,
)

GIB = 2**30
PROFILES = (
    MigProfile(0, "1g.18gb", 1, 18 * GIB, free=7),
    MigProfile(5, "2g.35gb", 2, 35 * GIB, free=3),
    MigProfile(9, "3g.71gb", 3, 71 * GIB, free=0),
    MigProfile(14, "7g.141gb", 7, 141 * GIB, free=1),
)
H200 = DeviceInfo(0, "GPU-aaaa", minor=0, memory_bytes=141 * GIB)
H200_MIG = DeviceInfo(
    1, "GPU-bbbb", minor=1, memory_bytes=141 * GIB, mig_capable=True, mig_enabled=True,
    mig_profiles=PROFILES,
)  # fmt: skip
L4 = DeviceInfo(2, "GPU-cccc", minor=4, memory_bytes=24 * GIB)
NODE = [H200, H200_MIG, L4]
MPS = SliceSettings(mig=True, mps=True, mps_available=True)


@pytest.mark.unit
def test_mig_where_enabled_and_a_free_profile_fits_else_mps_else_time() -> None:
    mig = plan_slice([1], 250, NODE, MPS)
    (g,) = mig.grants
    # a quarter of 7 slices -> 2 slices; 2g.35gb is the smallest free one with the memory
    assert (g.mode, g.mig_profile and g.mig_profile.name) == ("mig", "2g.35gb")
    assert g.memory_quota_bytes == 35 * GIB
    # 40 % of 7 slices -> 3; 3g.71gb has none free, so 7g.141gb
    assert plan_slice([1], 400, NODE, MPS).grants[0].mig_profile == PROFILES[3]
    off = plan_slice([1], 250, NODE, SliceSettings(mig=False, mps_available=True)).grants[0]
    assert (off.mode, off.why) == ("mps", "MPS (MIG is off (dsec cluster config set gpu.mig on))")
    no_mig = plan_slice([0], 250, NODE, MPS).grants[0]
    assert (no_mig.mode, no_mig.why) == ("mps", "MPS (the GPU cannot do MIG)")
    time_ = plan_slice([0], 250, NODE, SliceSettings(mps=True, mps_available=False)).grants[0]
    assert time_.mode == "time" and "no nvidia-cuda-mps-control" in time_.why
    assert plan_slice([0], 250, NODE, SliceSettings(mps=False)).grants[0].mode == "time"
    whole = plan_slice([0, 2], 0, NODE, MPS)
    assert [g.mode for g in whole.grants] == ["whole", "whole"] and whole.milli == 1000
    assert [g.memory_quota_bytes for g in whole.grants] == [141 * GIB, 24 * GIB]


@pytest.mark.unit
def test_only_the_granted_gpus_are_visible_and_mps_is_limited_by_share_and_memory() -> None:
    plan = plan_slice([2], 333, NODE, MPS, mps_pipe_dir="/run/dsec/mps")
    assert plan.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "GPU-cccc",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/dsec/mps/GPU-cccc",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "34",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8183M",  # 333/1000 of 24 GiB
    }
    assert plan.devices == ("nvidiactl", "nvidia-uvm", "nvidia4")
    assert plan.mps_pipes == ("GPU-cccc",)
    quota = plan_slice([2], 100, NODE, MPS, memory_quota_bytes=6 * GIB)
    assert quota.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert quota.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert plan_slice([2], 1, NODE, MPS).env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    two = plan_slice([0, 2], 1000, NODE, MPS)
    assert two.env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-cccc"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in two.env
    mig = with_mig_instance(
        plan_slice([1], 100, NODE, MPS), 1, "MIG-1234", ["nvidia-caps/nvidia-cap21"]
    )
    assert mig.env["CUDA_VISIBLE_DEVICES"] == "MIG-1234"
    assert mig.devices == ("nvidiactl", "nvidia-uvm", "nvidia1", "nvidia-caps/nvidia-cap21")
    with pytest.raises(
        SliceError, match=r"placed on GPU 7, which this node does not have \(GPUs: 0, 1, 2\)"
    ):
        plan_slice([7], 100, NODE, MPS)


PROC_DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
236 nvidia-caps
508 nvidia-uvm

Block devices:
  8 sd
200 nvidia-not-a-char
"""


def _run(program: list[tuple[int, ...]], major: int, minor: int, kind: int = 2) -> int:
    """Interpret the few BPF instructions the device program uses (ctx: type, major, minor)."""
    regs = [0] * 11
    ctx = {0: (1 << 16) | kind, 4: major, 8: minor}
    pc = 0
    while True:
        code, r, off, imm = program[pc]
        dst, src = r & 0xF, r >> 4
        pc += 1
        if code == 0x61:
            regs[dst] = ctx[off]
        elif code == 0x57:
            regs[dst] &= imm
        elif code == 0xB7:
            regs[dst] = imm
        elif code == 0x55:
            pc += off if regs[dst] != imm else 0
        elif code == 0x15:
            pc += off if regs[dst] == imm else 0
        elif code == 0x05:
            pc += off
        elif code == 0x95:
            return regs[0]
        else:
            raise AssertionError(f"unexpected opcode {code:#x} (src {src})")


@pytest.mark.unit
def test_the_device_cgroup_allows_only_the_units_nvidia_nodes() -> None:
    majors = nvidia_majors(PROC_DEVICES)
    assert majors == {"nvidia-frontend": 195, "nvidia-caps": 236, "nvidia-uvm": 508}
    plan = plan_slice([2], 500, NODE, MPS)
    guarded, allowed = device_rules(plan, majors, caps_minors=[21])
    assert guarded == {195, 236, 508}
    program = device_program(guarded, allowed)
    assert _run(program, 195, 4) == 1  # its GPU
    assert _run(program, 195, 0) == 0  # a neighbour's GPU
    assert _run(program, 195, 255) == 1  # nvidiactl
    assert _run(program, 508, 0) == 1 and _run(program, 508, 1) == 1  # nvidia-uvm(-tools)
    assert _run(program, 236, 21) == 1 and _run(program, 236, 22) == 0  # its MIG caps only
    assert _run(program, 1, 3) == 1  # /dev/null: left to the sandbox's other layers
    assert _run(program, 195, 0, kind=1) == 1  # a block device of that major: not ours


@pytest.mark.kernel
def test_the_device_program_refuses_a_device_in_the_kernel() -> None:
    """The same program, attached to a real cgroup: /dev/zero (1:5) is guarded, /dev/null (1:3)
    allowed; a process in the cgroup opens one and not the other."""
    root = Path("/sys/fs/cgroup/unified")
    root = root if (root / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    cg = root / f"dsec-devtest-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        attach_device_guard(cg, frozenset({1}), [DeviceRule(1, 3)])
        code = (
            "import errno\n"
            "for p in ('/dev/null', '/dev/zero'):\n"
            "    try:\n        open(p, 'rb').close(); print(p, 'ok')\n"
            "    except OSError as e:\n        print(p, errno.errorcode[e.errno])\n"
        )
        procs = cg / "cgroup.procs"
        out = subprocess.run(
            [sys.executable, "-c", code],
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        assert out.stdout.split("\n")[:2] == ["/dev/null ok", "/dev/zero EPERM"]
    finally:
        cg.rmdir()


@pytest.mark.unit
def test_usage_counts_only_the_units_processes() -> None:
    procs = [
        ProcessUsage(0, 100, 2 * GIB), ProcessUsage(0, 101, 1 * GIB),
        ProcessUsage(0, 999, 50 * GIB), ProcessUsage(1, 100, 3 * GIB),
    ]  # fmt: skip
    assert usage_of(procs, {100, 101}) == {0: 3 * GIB, 1: 3 * GIB}


@pytest.mark.unit
def test_the_quota_watch_warns_then_stops_after_the_grace() -> None:
    w = QuotaWatch({0: 10 * GIB}, warn_pct=90, grace_s=5)
    assert w.observe(0, {0: 5 * GIB}) is None
    warn = w.observe(1, {0: 9 * GIB + GIB // 2})
    assert warn is not None and warn.action == "warn"
    assert warn.message == "GPU 0: 9.50 GiB of its 10.00 GiB GPU memory quota (95 %)"
    assert w.observe(2, {0: 9 * GIB + GIB // 2}) is None  # said once
    over = w.observe(3, {0: 12 * GIB})
    assert over is not None and over.action == "over"
    assert over.message.endswith("over it; stopped in 5 s unless it frees memory")
    assert w.observe(4, {0: 12 * GIB}) is None
    assert w.observe(5, {0: 8 * GIB}) is None  # back under in time: forgiven
    assert w.observe(6, {0: 11 * GIB}).action == "over"  # type: ignore[union-attr]
    stop = w.observe(11.5, {0: 11 * GIB})
    assert stop is not None and (stop.action, stop.gpu_index, stop.used_bytes) == (
        "stop", 0, 11 * GIB,
    )  # fmt: skip
    assert "over it for 5.5 s; stopped so its neighbours on the GPU keep their memory" in (
        stop.message
    )
    assert w.stopped and w.observe(12, {0: 20 * GIB}) is None


@pytest.mark.unit
def test_a_zero_grace_stops_at_the_second_look() -> None:
    w = QuotaWatch({0: GIB, 3: GIB}, grace_s=0)
    assert w.observe(0, {3: 2 * GIB}).action == "over"  # type: ignore[union-attr]
    assert w.observe(0.1, {3: 2 * GIB}).action == "stop"  # type: ignore[union-attr]
