"""The supervisor of a sandbox restored by CRIU on the target node:
``python -m dsec_nodeagent.migration.restorer`` (its plan as two JSON lines on stdin).

It stands where :func:`dsec_nodeagent.sandbox.init.run` stands for a launched sandbox: outside
the sandbox's cgroup, the parent of its pid 1, the reader of its output. It

1. makes three pipes (stdout, stderr, pid 1's status) and runs ``criu restore`` with their
   write ends in place of the source's pipes (``--inherit-fd``), in the target's fresh cgroups
   (CRIU joins them before it forks the tree; ``--restore-sibling`` makes pid 1 our child);
   The root view's tmpfs is rebuilt from the source's copy in a mount namespace of its own.
2. reports ``{"restored": <pid 1>, "workload": <pid>, "ms": ...}`` (or ``{"error": ...}``) as one
   JSON line on stdout, then closes it. The tree stays stopped: the node agent continues it once
   the source released its copy;
3. copies the output into the sandbox's logs (appended to what the source wrote, which came with
   the sandbox's files) until pid 1 ends, and writes ``exit.json`` as a launched sandbox's
   supervisor does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

from dsec_nodeagent.sandbox.init import CappedLog, _outcome, _write_json_atomic, pump

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS = 0x00020000


def _say(record: dict[str, Any]) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def main() -> int:
    # Two lines on stdin: where the root view goes (before the source freezes the sandbox, so
    # this process's start and the root's rebuild stay out of the freeze), then the rest of the
    # plan (EOF instead: the migration was dropped; nothing of it outlives this process).
    plan: dict[str, Any] = json.loads(sys.stdin.readline())
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # The sandbox's root file system (a tmpfs: its mount points, links and files) is rebuilt in
    # a mount namespace of this process only: CRIU mounts the tree on it, the host never sees it.
    if libc.unshare(CLONE_NEWNS) != 0:
        _say({"error": f"unshare(CLONE_NEWNS): errno {ctypes.get_errno()}", "ms": 0})
        return 1
    for argv in (
        ["mount", "--make-rprivate", "/"],
        ["mount", "-t", "tmpfs", "-o", "mode=0755,size=4m", "tmpfs", plan["root"]],
        ["tar", "-C", plan["root"], "-xpf", plan["root_tar"]],
    ):
        step = subprocess.run(argv, capture_output=True, check=False)
        if step.returncode != 0:
            _say({"error": f"{' '.join(argv[:2])}: {step.stderr.decode()[-300:]}", "ms": 0})
            return 1
    rest = sys.stdin.readline()
    if not rest.strip():
        return 0
    plan.update(json.loads(rest))
    # Mount points the archive could not hold (a socket bound over a file): made again empty.
    for mountpoint, is_dir in plan.get("placeholders", []):
        path = plan["root"] + mountpoint
        if os.path.lexists(path):
            continue
        os.makedirs(path if is_dir else os.path.dirname(path), exist_ok=True)
        if not is_dir:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    ends = {"stdout": out_w, "stderr": err_w, "status": status_w}
    inherit = []
    for role, name in plan["pipes"].items():  # role -> pipe:[inode] of the source
        fd = ends[role]
        os.set_inheritable(fd, True)
        inherit += ["--inherit-fd", f"fd[{fd}]:{name}"]
    procs_files: list[str] = plan["cgroup_procs"]

    def join_cgroups() -> None:  # in CRIU's process, before exec: the tree is forked there
        for path in procs_files:
            with open(path, "w") as fh:
                fh.write("0")

    start = time.perf_counter()
    done = subprocess.run(
        [*plan["args"], *inherit],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=join_cgroups,  # a fresh single-threaded process: safe
        pass_fds=tuple(ends.values()),
        check=False,
    )
    ms = (time.perf_counter() - start) * 1000
    for fd in ends.values():
        os.close(fd)
    if done.returncode != 0:
        _say({"error": _tail(plan["log"], done.stdout), "ms": ms})
        return 1
    with open(plan["pidfile"]) as fh:
        init_pid = int(fh.read().strip())
    with open(f"/proc/{init_pid}/task/{init_pid}/children") as fh:
        children = fh.read().split()
    _say({"restored": init_pid, "workload": int(children[0]) if children else init_pid, "ms": ms})
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 1)
    os.close(null)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    logs = {
        name: CappedLog(os.open(plan[f"{name}_path"], flags, 0o640), plan[f"{name}_path"], None)
        for name in ("stdout", "stderr")
    }
    pump({out_r: logs["stdout"], err_r: logs["stderr"]}, init_pid)
    status = 0
    with contextlib.suppress(ChildProcessError):
        _, status = os.waitpid(init_pid, 0)
    raw = os.read(status_r, 64).decode().strip()
    outcome = _outcome(int(raw) if raw else status, bool(raw))
    outcome["logs"] = {name: log.finish() for name, log in logs.items()}
    _write_json_atomic(plan["exit_path"], outcome)
    return 0


def _tail(path: str, fallback: bytes) -> str:
    try:
        with open(path, errors="replace") as fh:
            lines = [ln.strip() for ln in fh if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    except OSError:
        lines = []
    return (" | ".join(lines[-4:]) or fallback.decode(errors="replace"))[-500:]


if __name__ == "__main__":
    sys.exit(main())
