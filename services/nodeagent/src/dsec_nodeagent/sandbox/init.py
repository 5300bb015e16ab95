"""The sandbox's pre-exec stage: ``python -m dsec_nodeagent.sandbox.init run|exec``.

Run as a fresh process (never forked from the asyncio node agent, whose threads make
``preexec_fn`` unsafe). It reads a *plan* (plain JSON, built by :mod:`.plan`) from an inherited
pipe and reports progress as JSON lines on another inherited pipe; standard library only, because
its import time is part of ``sandbox.ready``.

Process tree of ``run``::

    supervisor (host pid ns, not in the sandbox cgroup)   waits, then writes exit.json
      └─ init (pid 1 of a new pid ns; new mount/ipc/uts[/net] ns; in the cgroups)
           reaps orphans, forwards SIGTERM/SIGINT, reports the workload's wait status
           └─ workload: while init binds the root view: bounding set emptied, limits,
              no_new_privs, seccomp; at init's word: cwd, uid drop, Landlock, then execve

The supervisor stays outside the cgroup so that ``cgroup.kill`` (stop, OOM) cannot take the
record of how the sandbox ended with it; exit.json lets a restarted node agent learn the outcome
of a sandbox it did not start. It also keeps the seccomp filter's notification listener, which
the workload hands it (SCM_RIGHTS) before execve, at ``seccomp.SUPERVISOR_LISTENER_FD``: the node
agent takes it from there with pidfd_getfd(2), at launch and after a restart. No process of the
sandbox keeps the listener (it would answer its own refusals).
"""

from __future__ import annotations

import errno
import fcntl  # (imported here: see _seal_imports)
import marshal
import os
import resource
import signal
import stat
import sys
import termios
import time

from dsec_nodeagent.sandbox import cpuhint, landlock, seccomp, syscalls

try:  # the workload's execve in a sibling (_spawn.c), where the extension was built
    from dsec_nodeagent.sandbox._spawn import spawn as _spawn_sibling
except ImportError:  # (then the workload's process execs itself)
    _spawn_sibling = None

DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
"""The device nodes of every sandbox's ``/dev`` (bound from the host's)."""

# Neither json nor typing: together they cost more start-up time than every layer's set-up.
# The plan arrives marshalled; reports are Python literals (the manager reads them with
# ast.literal_eval).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

    Plan = dict[str, Any]


class _Reporter:
    """One record per line on the report pipe. A stage's timing is held and written with the
    next record sent (an error, the workload's ``exec``) or at :meth:`close`, in one atomic
    write (< PIPE_BUF): the node agent wakes a few times per start, not once per stage.

    JSON where ``json`` is loaded already (the zygote imports it once: the node agent reads a
    line in ~2 µs, right as the sandbox's workload starts), else a Python literal (a pre-exec
    stage started as a fresh interpreter does without the import; the node agent reads those
    with ``ast.literal_eval``, ~20 µs a line)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        json = sys.modules.get("json")
        self._encode = json.dumps if json is not None else repr
        self._held: list[str] = []

    def send(self, **record: Any) -> None:
        """Write ``record`` now, after the records held so far."""
        self.hold(**record)
        self.flush()

    def hold(self, **record: Any) -> None:
        """Keep ``record`` for the next :meth:`send` or :meth:`flush`: each write wakes the node
        agent, which on a small node takes CPU from this sandbox's start."""
        self._held.append(self._encode(record) + "\n")

    def flush(self) -> None:
        """Write the records held, as one write: atomic (the pipe's other writers' lines never
        come between them) while under ``PIPE_BUF``, else one write per record."""
        held, self._held = self._held, []
        if self.fd < 0 or not held:
            return
        data = "".join(held).encode()
        try:
            if len(data) <= PIPE_BUF:
                os.write(self.fd, data)
            else:
                for line in held:
                    os.write(self.fd, line.encode())
        except OSError:
            self.fd = -1  # the node agent went away; the sandbox still runs

    def stage(self, name: str, start_ns: int) -> None:
        self.hold(stage=name, start_ns=start_ns, end_ns=time.monotonic_ns())

    def close(self) -> None:
        if self.fd >= 0:
            self.flush()
            os.close(self.fd)
            self.fd = -1


PIPE_BUF = 4096
"""Writes to a pipe up to this many bytes are atomic (POSIX guarantees at least 512; Linux 4096)."""


def _describe(exc: BaseException) -> str:
    """The error and the line of this module that raised it (for ``sandbox.failed``)."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = f" (init.py:{frame.tb_lineno})" if frame is not None else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _read_plan(fd: int) -> Plan:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    plan: Plan = marshal.loads(b"".join(chunks))
    return plan


# ----------------------------------------------------------------------------- run


def run(plan: Plan, report: _Reporter) -> int:
    """Supervisor: new pid ns, fork init, pump the output into capped logs, record the outcome."""
    return supervise(prepare(plan["root"], [report.fd]), plan, report)


class Prepared:
    """What :func:`prepare` made: init, waiting for its plan, and the supervisor's ends."""

    def __init__(self, init_pid: int, start_ns: int, end_ns: int, fds: dict[str, Any]) -> None:
        self.init_pid = init_pid
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.status_r: int = fds["status_r"]
        self.holder: Any = fds["holder"]
        self.out_r: int = fds["out_r"]
        self.err_r: int = fds["err_r"]
        self.plan_sock: Any = fds["plan_sock"]  # None once handed to the node agent


def prepare(root: str, inherited: list[int] | None = None, ahead: bool = False) -> Prepared:
    """Everything of a sandbox that no plan decides, made ahead of it: a new pid namespace and
    its init, which enters new mount, IPC and UTS namespaces and mounts the root view's
    request-independent part (a tmpfs at ``root``, a private ``/proc`` with its read-only parts,
    ``/dev``) and then waits for its plan (:func:`_init_main`).

    The zygote's child calls this before its plan arrives, so this work overlaps the node
    agent's planning; init holds nothing of the host but ``/dev/null``, the pipes to its
    supervisor, and runs nothing until its plan (cgroups joined first) has come.
    ``inherited``: fds of this process init must not keep (closed in init at once).
    ``ahead``: made before its launch (the zygote's): the workload's process copies its pages
    while it waits (:func:`_prefault`).
    """
    import _socket  # the listener's hand-over; imported once, before the forks

    start = time.monotonic_ns()
    cpus = os.sched_getaffinity(0)  # init's, to widen back to (see _init_main)
    syscalls.unshare(syscalls.CLONE_NEWPID)
    status_r, status_w = os.pipe()
    holder, holder_peer = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    plan_sock, plan_peer = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # init never returns into its parent's code
            for fd in (status_r, out_r, err_r, *(inherited or ())):
                os.close(fd)
            holder.close()
            plan_sock.close()
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            _init_main(root, status_w, holder_peer.detach(), plan_peer.detach(), cpus, ahead)
        finally:
            os._exit(126)
    os.close(status_w)
    os.close(out_w)
    os.close(err_w)
    holder_peer.close()
    plan_peer.close()
    fds = {
        "status_r": status_r,
        "holder": holder,
        "out_r": out_r,
        "err_r": err_r,
        "plan_sock": plan_sock,
    }
    return Prepared(pid, start, time.monotonic_ns(), fds)


def abandon(prepared: Prepared) -> None:
    """No plan came (the launch was given up): init exits at the EOF; reap it."""
    if prepared.plan_sock is not None:
        prepared.plan_sock.close()
    prepared.holder.close()
    for fd in (prepared.status_r, prepared.out_r, prepared.err_r):
        os.close(fd)
    try:  # noqa: SIM105
        os.waitpid(prepared.init_pid, 0)
    except ChildProcessError:
        pass


SUPERVISOR_KEYS = ("log_bytes", "stdout_path", "stderr_path", "exit_path", "reap")
"""What of a plan its supervisor reads (:func:`supervise`); a zygote's supervisor gets these
only."""


def supervisor_plan(plan: Plan) -> Plan:
    """The part of ``plan`` a zygote's supervisor gets: no layout, environment or secret."""
    return {key: plan[key] for key in SUPERVISOR_KEYS if key in plan}


def supervise(prepared: Prepared, plan: Plan, report: _Reporter, raw: bytes | None = None) -> int:
    """Give init its plan (``raw``: as marshalled already) and the report pipe — unless the node
    agent gave them to init itself (the zygote's child) — then pump the logs and record the
    outcome."""
    import _socket

    pid = prepared.init_pid
    sock = prepared.plan_sock
    if sock is not None:
        data = raw if raw is not None else marshal.dumps(plan)
        try:
            sock.sendall(MOUNT_NOW)
            sent = sock.sendmsg(
                [data[:4096]],
                [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, report.fd.to_bytes(4, sys.byteorder))],
            )
            sock.sendall(data[sent:])
        except OSError:  # init died before its plan: its wait status tells the rest
            pass
        finally:
            sock.close()  # EOF: the plan is complete
    report.send(stage="fork", start_ns=prepared.start_ns, end_ns=prepared.end_ns, init_pid=pid)
    # Before closing the report channel: its EOF tells the node agent the listener is here.
    _keep_listener(prepared.holder)
    report.close()
    limit = plan.get("log_bytes")
    logs = {
        "stdout": CappedLog(1, plan.get("stdout_path", ""), limit),
        "stderr": CappedLog(2, plan.get("stderr_path", ""), limit),
    }
    # Copying the output is host CPU outside the sandbox's cgroup: at a lower priority (from
    # the second chunk on), a flood of output waits on the pipe rather than taking CPU from the
    # node's other work; the first line is not held back behind that work.
    pump({prepared.out_r: logs["stdout"], prepared.err_r: logs["stderr"]}, pid, renice=10)
    _, init_status = os.waitpid(pid, 0)
    status = _wait_status(os.read(prepared.status_r, 64))
    outcome = _outcome(init_status if status is None else status, status is not None)
    outcome["logs"] = {name: log.finish() for name, log in logs.items()}
    reap = plan.get("reap") or {}
    orphaned = bool(reap) and os.path.exists(reap["marker"])
    if orphaned:  # read before the cgroup goes: the node agent classifies the exit with them
        outcome["counters"] = {
            k: _counter(path, key) for k, (path, key) in reap["counters"].items()
        }
    _write_json_atomic(plan["exit_path"], outcome)
    if orphaned:
        _remove_cgroups(reap["dirs"])
    return 0


def _counter(path: str, key: str) -> int:
    try:
        with open(path) as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _remove_cgroups(dirs: list[str], timeout_s: float = 2.0) -> None:
    """No node agent watches this sandbox (``dsec down --keep-sandboxes``, an agent stopped to be
    restarted): remove its cgroups now — the kernel then releases the egress programs attached to
    them — instead of leaving them until the next node agent's start, which cleans up the rest."""
    deadline = time.monotonic() + timeout_s
    for path in dirs:
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:  # tasks still exiting: a moment
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


class CappedLog:
    """A log file that keeps the first and the last ``limit / 2`` bytes of a stream.

    The head goes straight to ``fd`` (the log file, readable live); past it, the stream goes to
    two rotating tail segments beside the file, so at most ``limit`` bytes are ever on disk. At
    the end the kept tail is appended after a line saying how many bytes were dropped.
    ``limit`` ``None``: everything is kept.
    """

    def __init__(self, fd: int, path: str, limit: int | None) -> None:
        self.fd = fd
        self.path = path
        self.limit = limit
        self.head = limit - limit // 2 if limit is not None else -1
        self.head_left = self.head
        self.segment = max(1, (limit // 2) // 2) if limit is not None else 0
        self.total = 0
        self.dropped = 0
        self.tail_fd = -1
        self.tail_size = 0

    def write(self, data: bytes) -> None:
        self.total += len(data)
        if self.head_left < 0:
            _write_fully(self.fd, data)
            return
        if self.head_left > 0:
            n = min(self.head_left, len(data))
            _write_fully(self.fd, data[:n])
            self.head_left -= n
            data = data[n:]
        while data:
            if self.tail_fd < 0 or self.tail_size >= self.segment:
                self._rotate()
            n = min(self.segment - self.tail_size, len(data))
            _write_fully(self.tail_fd, data[:n])
            self.tail_size += n
            data = data[n:]

    def _rotate(self) -> None:
        current, previous = self.path + ".tail.1", self.path + ".tail.0"
        if self.tail_fd >= 0:
            os.close(self.tail_fd)
            try:  # noqa: SIM105  (no contextlib: start-up latency)
                self.dropped += os.stat(previous).st_size
            except FileNotFoundError:
                pass
            os.replace(current, previous)
        self.tail_fd = os.open(current, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        self.tail_size = 0

    def finish(self) -> dict[str, int]:
        """Append the kept tail (after a truncation note); return ``{bytes, dropped}``."""
        if self.tail_fd >= 0:
            os.close(self.tail_fd)
            if self.dropped:
                kept = self.total - self.dropped - self.head
                note = (
                    f"\n[dsec: {self.dropped} bytes of output dropped here; the log keeps the "
                    f"first {self.head} and the last {kept} bytes "
                    f"(resources.log_bytes = {self.limit})]\n"
                )
                _write_fully(self.fd, note.encode())
            for part in (self.path + ".tail.0", self.path + ".tail.1"):
                try:
                    with open(part, "rb") as fh:
                        while chunk := fh.read(1 << 20):
                            _write_fully(self.fd, chunk)
                    os.unlink(part)
                except FileNotFoundError:
                    pass
        return {"bytes": self.total, "dropped": self.dropped}


def pump(streams: dict[int, CappedLog], init_pid: int, renice: int = 0) -> None:
    """Copy each pipe into its log until init ends, then drain what is left and stop.

    Init's end kills every process of the sandbox; a copy of a pipe's write end that escaped
    it (passed over a socket) must not keep the supervisor waiting, so EOF is not awaited then.
    ``renice``: lower this process's priority by that much once the first chunk is copied.
    """
    import select

    pidfd = os.pidfd_open(init_pid)
    poller = select.poll()
    for fd in (*streams, pidfd):
        poller.register(fd, select.POLLIN)
    open_fds = set(streams)
    while open_fds:
        ready = dict(poller.poll())
        if pidfd in ready and not any(fd in ready for fd in open_fds):
            break
        for fd in open_fds & set(ready):
            chunk = os.read(fd, 1 << 16)
            if chunk:
                streams[fd].write(chunk)
                if renice:
                    os.nice(renice)
                    renice = 0
                continue
            poller.unregister(fd)
            os.close(fd)
            open_fds.discard(fd)
    os.close(pidfd)
    for fd in open_fds:
        os.set_blocking(fd, False)
        try:
            while chunk := os.read(fd, 1 << 16):
                streams[fd].write(chunk)
        except BlockingIOError:
            pass
        os.close(fd)


def _write_fully(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:
            return  # the log's disk is gone or full: the sandbox must not block on it


def _keep_listener(holder: Any) -> None:
    """Receive the workload's seccomp listener (or EOF: it failed before) and pin it."""
    import _socket

    try:
        _, ancillary, _, _ = holder.recvmsg(1, _socket.CMSG_LEN(4), _socket.MSG_CMSG_CLOEXEC)
    finally:
        holder.close()
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(data) >= 4:
            fd = int.from_bytes(data[:4], sys.byteorder)
            os.dup2(fd, seccomp.SUPERVISOR_LISTENER_FD, inheritable=False)
            os.close(fd)


def _wait_status(data: bytes) -> int | None:
    """The workload's wait status as init (or its reaper, which runs as the sandbox's uid)
    wrote it; ``None`` when there is none, or what came is no wait status."""
    text = data.strip()
    if not text.isdigit() or len(text) > 5 or int(text) > 0xFFFF:
        return None
    return int(text)


def _outcome(wait_status: int, from_init: bool) -> dict[str, Any]:
    """Exit code and signal of the workload (or of init, when it died first)."""
    result: dict[str, Any] = {"source": "workload" if from_init else "init", "time": time.time()}
    if os.WIFSIGNALED(wait_status):
        result["signal"] = os.WTERMSIG(wait_status)
        result["exit_code"] = 128 + os.WTERMSIG(wait_status)
    else:
        result["signal"] = None
        result["exit_code"] = os.WEXITSTATUS(wait_status)
    return result


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    import json  # after the sandbox ended: start-up time no longer matters

    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


MOUNT_NOW = b"m"
"""To init on its plan socket, before the plan: copy the host's mount tree and make the root
view's plan-independent part now."""
MOUNT_SHARED = b"M"
""":data:`MOUNT_NOW`, followed by entries of the root view to bind at once, beside the planning
(:func:`_prebind`): their marshalled bytes, after their length (4 bytes, big-endian)."""
SHARED_MAX = 1 << 20
"""The most bytes of entries :data:`MOUNT_SHARED` may announce."""


def _init_main(
    root: str, status_w: int, holder_fd: int, plan_fd: int, cpus: set[int], ahead: bool = False
) -> None:
    """Pid 1 of the sandbox: the plan-independent namespaces and mounts, then (once the plan
    and the report pipe came over ``plan_fd``) cgroups, the rest of the root view, the
    workload. ``cpus``: the CPU affinity it was forked with; ``ahead``: see :func:`prepare`.
    Never returns."""
    error = None
    ns_ns = mounts_ns = 0
    prebound: list[dict[str, Any]] = []
    try:
        start = time.monotonic_ns()
        syscalls.unshare(syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWUTS)
        ns_ns = time.monotonic_ns() - start
    except BaseException as exc:  # reported once there is a report pipe
        error = _describe(exc)
    # The workload's process, forked now (for a shell made ahead: long before its launch), so
    # the fork is not on the start's path; it joins init's mount namespace once there is one.
    early: tuple[int, Any] | None = None
    if error is None:
        try:
            early = _fork_early([status_w, plan_fd], holder_fd, cpus, ahead)
        except BaseException:  # forked after the plan instead (a failure there is reported)
            early = None
    # The host's mount tree is copied only at the word "m" (MOUNT_NOW): a shell made before its
    # launch (SandboxManager's pooled one) holds no copy of the host's mounts while it waits,
    # and its copy is as fresh as the launch's own (its disk quota mounted before the word).
    shared = b""
    try:
        word = os.read(plan_fd, 1)
        if word == MOUNT_SHARED:
            shared = _read_exact(plan_fd, int.from_bytes(_read_exact(plan_fd, 4), "big"))
        elif word != MOUNT_NOW:
            os._exit(126)
        # The node agent may have kept init off its own CPU for this wake-up (a hint: see
        # cpuhint.elsewhere); the mask init was forked with, back at once, before anything
        # forks from init. It can fail only if none of those CPUs is left: then every CPU.
        _widen(cpus)
    except BaseException:
        os._exit(126)
    if error is None:
        try:
            start = time.monotonic_ns()
            syscalls.unshare(syscalls.CLONE_NEWNS)
            ns_ns += time.monotonic_ns() - start
            start = time.monotonic_ns()
            prepare_root(root)
            if shared:  # (while the node agent plans)
                prebound = _prebind(root, shared)
            mounts_ns = time.monotonic_ns() - start
        except BaseException as exc:
            error = _describe(exc)
    if early is not None:
        try:  # the early process joins this mount namespace now, while the node agent plans
            if error is not None:
                raise RuntimeError(error)
            _share_policy(early[0])  # (copying its pages, perhaps: see _prefault)
            _join_early(early[1])
            _share_policy(early[0])
        except BaseException:  # EOF: it exits having run nothing (reaped as any orphan)
            early[1].close()
            early = None
    try:
        data, fds = _receive_plan(plan_fd, 2)
    except BaseException:
        os._exit(126)
    if len(fds) not in (1, 2):  # given up before its plan: nothing ran here
        os._exit(126)
    report = _Reporter(fds[0])
    go = fds[1] if len(fds) == 2 else -1
    if go >= 0:  # straight from the node agent (the zygote's): the hand-over ends here
        report.hold(stage="spawn", end_ns=time.monotonic_ns())
    workload = -1
    try:
        if error is not None:
            raise RuntimeError(error)
        plan: Plan = marshal.loads(data)
        start = time.monotonic_ns()
        if plan["unshare_net"]:
            syscalls.unshare(syscalls.CLONE_NEWNET)
        syscalls.sethostname(plan["hostname"])
        # Each layer's whole time, the part made before the plan included (a span that long).
        report.hold(stage="namespaces", start_ns=start - ns_ns, end_ns=time.monotonic_ns())
        # The workload's process: forked ahead (it gets the plan now), or now when it could
        # not be (its network namespace is the one just made; a plan too large for one
        # message). It runs nothing until init's word (written once it is in the cgroups and
        # the root view is in place); if init dies first, the pid namespace ends with it.
        begin_w = -1
        joining = False  # the workload's process joins this mount namespace on its own
        if early is not None:
            workload, sock = early
            if not plan["unshare_net"] and len(data) <= EARLY_PLAN_MAX:
                try:  # noqa: SIM105  (init goes on binding: the process not behind it)
                    cpuhint.elsewhere(workload)
                except OSError:
                    pass  # (a hint: it ended meanwhile; its EOF is reported below)
                begin_w = _hand_plan(sock, data, report.fd)
                joining = begin_w >= 0
            else:  # EOF: it exits having run nothing (reaped as any orphan)
                sock.close()
        if begin_w < 0:
            workload, begin_w = _fork_workload(plan, report, holder_fd, [status_w, go])
        start = time.monotonic_ns()
        skip = _prebound_kept(plan, prebound)
        if prebound and skip is None:  # not this plan's: the root view made again, plainly
            _prepare_again(root)
        bind_root(plan, root, skip)
        mounts_ns += time.monotonic_ns() - start
        # The root view is bound: the workload's process builds its Landlock ruleset in a
        # detached copy of it while init joins the cgroups and pivots (and enforces it after
        # the word below).
        _send_bound(begin_w, root)
        if go >= 0:  # the node agent made the cgroups meanwhile: wait for its word
            told = os.read(go, 1)
            os.close(go)
            if not told:  # the launch failed there: nothing of the sandbox ran
                os._exit(126)
        start = time.monotonic_ns()
        _join_cgroups(plan["cgroup_procs"], workload)
        # OOM should take the workload, not init; needs CAP_SYS_RESOURCE, not always held.
        # (No contextlib here: every import is start-up latency.)
        try:  # noqa: SIM105
            _write("/proc/self/oom_score_adj", "-1000")
        except PermissionError:
            pass
        report.stage("cgroup_join", start)
        if joining:
            _share_policy(workload)  # (it may have made itself idle after the word: _prefault)
            _await_joined(begin_w)
        start = time.monotonic_ns()
        _seal_imports()
        pivot_root(root)
        if plan.get("reaper_exec") and not plan.get("tty"):
            _sandbox_null_stdin()
        report.hold(stage="mounts", start_ns=start - mounts_ns, end_ns=time.monotonic_ns())
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
        # A stop that came before pid 1 has its forwarding handler (it is installed below, or
        # by the reaper's new interpreter after its exec) was dropped: pid 1 ignores a signal
        # it has no handler for, and the stop waited out its grace for a SIGKILL. Blocked, it
        # stays pending (across the exec too) until the handler is in place.
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))
        os.write(begin_w, BEGIN)
    except BaseException as exc:  # report every failure, then die: nothing else can
        report.send(error=_describe(exc) if error is None else error, stage="init")
        os._exit(126)  # the workload's process, waiting, ends with the pid namespace
    os.close(holder_fd)
    report.close()
    workload = _successor(begin_w, workload)
    if plan.get("reaper_exec"):
        _exec_reaper(plan, workload, status_w)
    os._exit(_reap_until(workload, status_w))


SPAWNED = b"P"
"""The workload's process to init, with a pid: the workload is that process, spawned (its
``execve`` done in a sibling sharing its memory, :func:`_spawn_workload`); this one exits."""


def _successor(sock_fd: int, workload: int) -> int:
    """The workload's pid once it runs: ``workload`` (the process init forked, which exec'd
    itself or failed: EOF), or the one it spawned (:data:`SPAWNED`). Read before init reaps
    anything: a workload that ends at once is reaped as the workload."""
    try:
        word = os.read(sock_fd, 32)
    except OSError:  # ECONNRESET: it ended with a word of init's unread
        word = b""
    finally:
        os.close(sock_fd)
    if word[:1] == SPAWNED and word[1:].isdigit() and int(word[1:]) > 1:
        return int(word[1:])
    return workload


def _seal_imports() -> None:
    """Find no module on a path from here on: every one this process needs is loaded (at the
    top of this module, or by :func:`prepare`/:func:`exec_into`). Called before this process
    enters a sandbox's mount namespace or pivots into its view, where the host interpreter's
    paths name what the sandbox shows there, which its spec may have put (a ``write_allowed``
    path where the node agent's standard library sits, when the sandbox has another runtime):
    a lazy import there ran the tenant's module as root with every capability (a review's
    ``import resource`` in ``dsec sandbox exec``). A missed import fails instead."""
    sys.path[:] = []
    sys.path_importer_cache.clear()


def _sandbox_null_stdin() -> None:
    """The sandbox's own /dev/null on stdin (not the host's, opened before pivot_root): no
    process of the sandbox then holds a file of the host's mount tree, which a checkpoint (CRIU,
    docs/migration.md) could not name."""
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)


BOUND = b"b"
"""Init to the workload's process: the root view is bound (at ``root``, not yet pivoted to)."""
BEGIN = b"1"
"""Init to the workload's process: cgroups joined, root view in place: go on to execve."""


def _fork_workload(
    plan: Plan, report: _Reporter, holder_fd: int, init_only: list[int]
) -> tuple[int, int]:
    """Fork the workload's process once the plan is here; ``(its pid, init's end of their
    SOCK_SEQPACKET pair)``: the child closes init's own fds (``init_only``), then
    :func:`_workload_main`. Where it could be forked ahead, :func:`_fork_early` did."""
    pid, sock = _fork_paired(init_only)
    if pid == 0:  # (a reporter of its own: not a copy of the records init holds)
        _workload_main(plan, _Reporter(report.fd), holder_fd, sock.detach())
    fd: int = sock.detach()
    return pid, fd


def _fork_paired(init_only: list[int]) -> tuple[int, Any]:
    """Fork the workload's process with a SOCK_SEQPACKET pair between it and init: ``(its
    pid, init's end)`` in init; ``(0, its end)`` in the child, which has closed init's own fds
    (``init_only``; -1s are skipped) and exits 126 where it could not."""
    import _socket

    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            for fd in init_only:
                if fd >= 0:
                    os.close(fd)
        except BaseException:
            os._exit(126)
        return 0, theirs
    theirs.close()
    return pid, ours


EARLY_PLAN_MAX = 1 << 16
"""The largest plan (marshalled) init hands to a workload process forked ahead; a larger one
goes to a process forked after it (a plan is ~8 KB; its seccomp program is most of it)."""


PREFAULT_CHUNK = 128 << 10
PREFAULT_MAPPING_MAX = 64 << 20


def _prefault(wake_fd: int) -> None:
    """Copy now, while this process (the workload's, forked ahead) waits on ``wake_fd``, and
    only with CPU nothing else wants (``SCHED_IDLE``), the pages it still shares copy-on-write
    with init: every private writable mapping of at most 64 MiB, in 128 KiB steps, until
    ``wake_fd`` is readable (the launch came: the rest is copied at its first write, as
    without this). A forked Python process writes to most of its pages (reference counts),
    each first write a fault (~1.5-2 us on the project's VM): ~400 in this process during a
    start, on its path. The copies go with its ``execve``.

    Only where this process may leave ``SCHED_IDLE`` again (``CAP_SYS_NICE``): its policy and
    priority are then put back as they were once the copying stops, and init, which wakes it,
    gives it its own (the same) before and after the word (:func:`_share_policy`), so the
    word is not queued behind other work. :func:`_settle_scheduling` sets it again before the
    uid drop, whatever happened meanwhile."""
    global _POLICY_BEFORE
    import select

    poller = select.poll()  # (select refuses fds past 1,024)
    poller.register(wake_fd, select.POLLIN)
    if poller.poll(0) or not _may_renice():
        return
    try:
        with open("/proc/self/maps", "rb") as maps:
            lines = maps.read().splitlines()
        before = (os.sched_getscheduler(0), os.sched_getparam(0))
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return
    _POLICY_BEFORE = before
    try:
        for line in lines:
            fields = line.split(None, 5)
            if len(fields) < 5 or fields[1][:2] != b"rw" or fields[1][3:4] != b"p":
                continue
            if len(fields) == 6 and fields[5].startswith(b"[v"):  # [vvar], [vdso], [vsyscall]
                continue
            low, _, high = fields[0].partition(b"-")
            start, end = int(low, 16), int(high, 16)
            if end - start > PREFAULT_MAPPING_MAX:
                continue
            while start < end:
                if poller.poll(0):
                    return
                step = min(PREFAULT_CHUNK, end - start)
                if syscalls.populate_write(start, step):
                    break  # a mapping it refuses, a kernel before 5.14: the next one
                start += step
    finally:
        try:  # noqa: SIM105
            os.sched_setscheduler(0, *before)
        except OSError:
            pass  # (refused: _exec_workload fails the start rather than exec at SCHED_IDLE)


_POLICY_BEFORE: tuple[int, Any] | None = None
"""The scheduling policy and priority :func:`_prefault` found, while it may have changed them."""

CAP_SYS_NICE = 23


def _may_renice() -> bool:
    """Whether this process may leave ``SCHED_IDLE`` again: ``CAP_SYS_NICE`` in the host's user
    namespace (the kernel asks there; the capability within another counts for nothing)."""
    try:
        with open("/proc/self/uid_map", "rb") as uid_map:
            if uid_map.read().split() != [b"0", b"0", b"4294967295"]:
                return False
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        pass
    return False


def _share_policy(pid: int) -> None:
    """Give ``pid`` (the workload's process, maybe at ``SCHED_IDLE`` in :func:`_prefault`)
    this process's scheduling policy and priority: the ones it was forked with."""
    try:  # noqa: SIM105
        os.sched_setscheduler(pid, os.sched_getscheduler(0), os.sched_getparam(0))
    except OSError:
        pass


def _widen(cpus: set[int]) -> None:
    """This process's CPU affinity back to ``cpus``; every CPU if none of them is left."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def _fork_early(
    init_only: list[int], holder_fd: int, cpus: set[int], ahead: bool = False
) -> tuple[int, Any]:
    """Fork the workload's process before its launch: ``(its pid, init's end of a
    SOCK_SEQPACKET pair)``. It closes init's own fds (``init_only``) at once and holds nothing
    of the node agent while it waits. Over the pair come, as messages: init's mount namespace
    (:func:`_join_early`), then the marshalled plan with the report pipe (SCM_RIGHTS), then
    the words of :func:`_workload_main`. EOF at any point (the launch was
    given up; the plan needs a network namespace this process is not in): it exits having run
    nothing.

    Init forks it before its launch's word (a shell made ahead), so the fork (a copy of a
    Python process, ~0.4 ms on the project's VM) is not on the start's path. It shares init's
    pid, IPC and UTS namespaces from the fork on. ``cpus``: the CPU affinity init was forked
    with, set again at once (the node agent's hint may have narrowed init's before the fork)
    and when its plan came (init's :func:`.cpuhint.elsewhere`). ``ahead``: it copies its pages
    while it waits (:func:`_prefault`)."""
    pid, sock = _fork_paired(init_only)
    if pid == 0:
        try:
            _widen(cpus)
            if ahead:
                _prefault(sock.fileno())
            word, fds = _recv_fds(sock, 16, 1)
            if word != JOIN or len(fds) != 1:
                os._exit(126)
            _seal_imports()
            syscalls.setns(fds[0], syscalls.CLONE_NEWNS)  # (root and cwd: its root)
            os.close(fds[0])
            sock.send(JOINED)
            data, fds = _recv_fds(sock, EARLY_PLAN_MAX, 1)
            _widen(cpus)
            if len(fds) != 1 or not data:
                os._exit(126)
            plan: Plan = marshal.loads(data)
            begin_r = sock.detach()
        except BaseException:
            os._exit(126)
        _workload_main(plan, _Reporter(fds[0]), holder_fd, begin_r)
    return pid, sock


def _hand_plan(sock: Any, data: bytes, report_fd: int) -> int:
    """Give the workload process forked ahead its marshalled plan and the report pipe; the
    socket's fd (detached from ``sock``), or -1 having closed it where that process could not
    take them (it died; a socket buffer smaller than the plan)."""
    import _socket  # (loaded already: prepare() imported it)

    rights = report_fd.to_bytes(4, sys.byteorder)
    try:
        sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    except OSError:
        sock.close()
        return -1
    fd: int = sock.detach()
    return fd


JOIN = b"j"
"""Init to the workload's process forked ahead: join my mount namespace (with its fd)."""
JOINED = b"J"
"""The workload's process forked ahead to init: I am in your mount namespace."""


def _await_joined(sock_fd: int) -> None:
    """Wait for the workload's process to say it joined this mount namespace (JOINED; sent
    long before, as a rule). Init must not pivot before: ``setns`` between ``pivot_root`` and
    the old root's detach gives the old root, the host's tree (a process kept off the CPU,
    as one copying its pages at SCHED_IDLE is, can take that long to read its word)."""
    try:
        word = os.read(sock_fd, 16)
    except OSError:  # ECONNRESET: it ended with words of init's unread
        word = b""
    if word != JOINED:
        raise RuntimeError("the workload's process ended before it joined the sandbox's mounts")


def _join_early(sock: Any) -> None:
    """Send the early workload process init's new mount namespace."""
    import _socket

    mount_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        rights = mount_ns.to_bytes(4, sys.byteorder)
        sock.sendmsg([JOIN], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    finally:
        os.close(mount_ns)


def _send_bound(sock_fd: int, root: str) -> None:
    """Word BOUND to the workload's process, with a detached copy of the bound root view
    (``open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)``) to resolve its Landlock paths in: the same
    mounts and inodes, and nothing can be mounted over its root, as ``pivot_root`` stacks the
    host's tree over the view's own root until init detaches it. Without ``open_tree`` (before
    5.2) the word comes alone and the ruleset is built after the pivot."""
    import _socket

    try:
        view = syscalls.open_tree_clone(root)
    except OSError:
        view = -1
    sock = _socket.socket(fileno=sock_fd)
    try:
        rights = (
            []
            if view < 0
            else [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, view.to_bytes(4, sys.byteorder))]
        )
        sock.sendmsg([BOUND], rights)
    finally:
        sock.detach()
        if view >= 0:
            os.close(view)


def _workload_main(plan: Plan, report: _Reporter, holder_fd: int, begin_r: int) -> NoReturn:
    """The workload's process, forked by init: confine what needs neither the cgroups nor the
    root view, then read init's words on ``begin_r`` (a SOCK_SEQPACKET socket): BOUND once
    init has bound the root view, with a detached copy of it (build the Landlock ruleset
    there, close it), BEGIN once this
    process is in the sandbox's cgroups (init moves it there with itself) and the root view is
    in place (pivot_root moved this process's root and cwd too). EOF instead: init failed, and
    this process exits having run nothing. Then :func:`_exec_workload`. Never returns."""
    # What needs neither the cgroups nor the root view, done while init binds the root view
    # (on another CPU): the capability bounding set, limits, no_new_privs, the seccomp
    # filter. The rest (cwd, uid, Landlock: they need the root view) waits for the word.
    _seal_imports()  # (init pivots this process's root into the view too)
    try:
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
        _confine_early(plan, report, holder_fd)
    except BaseException:  # (_confine_early reports its own failures, then exits)
        os._exit(127)
    ruleset = -1
    try:
        import _socket

        sock = _socket.socket(fileno=begin_r)
        told, fds = _recv_fds(sock, 16, 1)
        if told == BOUND:
            if fds:
                ruleset = _build_landlock(plan, report, fds[0])
                os.close(fds[0])
            told, _ = _recv_fds(sock, 16, 0)
        sock.detach()  # (kept: the workload's pid goes to init over it, _spawn_workload)
    except BaseException:
        os._exit(126)
    if told != BEGIN:
        os._exit(126)
    try:  # as init is by now: no file of the host's mount tree on stdin (not dumpable: above)
        if plan.get("reaper_exec") and not plan.get("tty"):
            _sandbox_null_stdin()
    except BaseException:
        os._exit(126)
    _exec_workload(plan, report, ruleset, begin_r)


# Pid 1 once it has exec'd the sandbox's own interpreter: the same loop as _reap_until, with
# nothing of the host's mount tree mapped (this module was loaded before pivot_root), so that
# CRIU can checkpoint the whole sandbox (docs/migration.md).
REAPER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\n"  # PR_SET_DUMPABLE 0, as before the exec
    "w, fd = int(sys.argv[1]), int(sys.argv[2])\n"
    "def fwd(n, _f):\n"
    "    try: os.kill(-1, n)\n"
    "    except ProcessLookupError: pass\n"
    "signal.signal(signal.SIGTERM, fwd)\n"
    "signal.signal(signal.SIGINT, fwd)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))\n"
    "while True:\n"
    "    try: pid, st = os.waitpid(-1, 0)\n"
    "    except ChildProcessError: os._exit(1)\n"
    "    if pid == w:\n"
    "        os.write(fd, str(st).encode()); os._exit(0)\n"
)


def _exec_reaper(plan: Plan, workload: int, status_w: int) -> None:
    """Replace this process image by :data:`REAPER` (run by the sandbox's interpreter, which is
    bound at the same path inside), confined as the workload is (:func:`_confine_reaper`); on
    any failure, reap here as before."""
    python = plan["python"]
    try:
        os.setsid()  # a session of its own: CRIU needs every session leader inside the sandbox
        _confine_reaper(plan)
        os.set_inheritable(status_w, True)
        os.execv(python, [python, "-S", "-I", "-c", REAPER, str(workload), str(status_w)])
    except OSError:
        os.set_inheritable(status_w, False)


def _confine_reaper(plan: Plan) -> None:
    """Everything the workload has, before the reaper's ``execve``: the sandbox's uid and gid,
    no capabilities (bounding and ambient sets emptied, the uid change clears the rest),
    ``no_new_privs``, the Landlock ruleset and the seccomp filter (without a listener: a refused
    call fails with ``ENOSYS``). The reaper is a dynamically linked interpreter run from the
    sandbox's view, where the spec's own files may sit at paths its loader and C library read
    (``/etc/ld.so.preload`` under ``workdir: /etc``, a locale under a mount): run as root with
    every capability, as it was, a tenant's library ran as the sandbox's pid 1 and could mount
    the host's disk. Reaping and forwarding a stop to the sandbox's processes need nothing
    more (they run as that uid). Raises ``OSError`` when a step fails (then init reaps itself,
    having loaded nothing of the view)."""
    _limit(plan)
    # (no signal scope: the reaper forwards a stop to the workload, in a domain of its own)
    ruleset = _ruleset(plan, signals=False)
    try:
        landlock.enforce(ruleset, plan["landlock"]["abi"])
    finally:
        os.close(ruleset)
    seccomp.install(bytes.fromhex(plan["seccomp"]))
    _drop_privileges(plan)


def _reap_until(workload: int, status_w: int) -> int:
    """Reap every child until the workload ends; forward stop signals to the whole ns."""

    def forward(signum: int, _frame: object) -> None:
        try:  # noqa: SIM105
            os.kill(-1, signum)  # from pid 1: every process of the namespace but itself
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))  # held till now
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if pid == workload:
            os.write(status_w, str(status).encode())
            os.close(status_w)
            return 0


def _join_cgroups(procs_files: list[str], also: int = -1) -> None:
    """Move this process (and the process ``also``, when given) into each cgroup."""
    for path in procs_files:
        _write(path, "0")  # "0" = the writing process itself
        if also > 0:
            _write(path, str(also))


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the root view

_NOSUID_NODEV = syscalls.MS_NOSUID | syscalls.MS_NODEV


def prepare_root(root: str) -> None:
    """The root view's part no plan decides: a private mount tree, a tmpfs at ``root`` holding
    ``/proc`` (this pid namespace's, its host-wide files read-only) and ``/dev`` (the standard
    nodes). Made by init before its plan arrives (:func:`prepare`)."""
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE, None)
    syscalls.mount("tmpfs", root, "tmpfs", _NOSUID_NODEV, "mode=0755,size=4m")
    os.mkdir(root + "/proc", 0o755)  # (the tmpfs was just mounted: nothing in it to follow)
    _mount_proc(root + "/proc")
    os.mkdir(root + "/dev", 0o755)
    _mount_dev(root + "/dev", DEV_NODES)


def bind_root(plan: Plan, root: str, skip: set[int] | None = None) -> None:
    """The plan's entries on the prepared tmpfs at ``root`` (:func:`prepare_root`), but those
    whose index is in ``skip`` (bound already: :func:`_prebind`)."""
    for index, entry in enumerate(plan["layout"]):
        if skip is None or index not in skip:
            _apply_entry(root, entry, plan)


def _prebind(root: str, data: bytes) -> list[dict[str, Any]]:
    """Bind, before the plan comes, the entries of the root view the node agent expects it to
    share with the previous plans of the same runtime (the runtime's directories and links, the
    semantic layer's site: the plan's ``shared``), in their order; the entries bound. Kept only
    where the plan names exactly these as its shared ones (:func:`_prebound_kept`); one that
    fails here (a source gone meanwhile) makes the root view again, plainly."""
    entries: list[dict[str, Any]] = marshal.loads(data)
    try:
        for entry in entries:
            _apply_entry(root, entry, {})
    except Exception:  # (whatever failed: the view is made again, plainly)
        _prepare_again(root)
        return []
    return entries


def _prebound_kept(plan: Plan, prebound: list[dict[str, Any]]) -> set[int] | None:
    """The indices in the plan's layout of the entries :func:`_prebind` bound, when they are
    exactly its ``shared`` entries, in order, and no other entry of it lies above or at one of
    them (the depth order puts an outer mount first: binding the shared ones first is then the
    same root view); else ``None``."""
    if not prebound:
        return None
    layout = plan["layout"]
    shared = plan.get("shared") or []
    try:
        if [layout[index] for index in shared] != prebound:
            return None
    except (IndexError, TypeError):
        return None
    kept = set(shared)
    paths = [_components(entry["path"]) for entry in prebound]
    for index, entry in enumerate(layout):
        if index in kept:
            continue
        outer = _components(entry["path"])
        if any(path[: len(outer)] == outer for path in paths):
            return None
    return kept


def _components(path: str) -> list[str]:
    """A path's names (``//a/./b/`` and ``/a/b``: ``["a", "b"]``; ``/``: none)."""
    return [name for name in path.split("/") if name and name != "."]


def _prepare_again(root: str) -> None:
    """Drop the root view's tmpfs with everything bound on it, and prepare it again."""
    syscalls.umount2(root, syscalls.MNT_DETACH)
    prepare_root(root)


def pivot_root(root: str) -> None:
    """Make ``root`` (bound by :func:`bind_root`) this mount namespace's root, read-only."""
    os.chdir(root)
    # pivot_root(".", ".") stacks the old root under the new one; detaching it leaves only ours.
    syscalls.pivot_root(".", ".")
    syscalls.umount2(".", syscalls.MNT_DETACH)
    os.chdir("/")
    syscalls.mount(
        None,
        "/",
        None,
        syscalls.MS_REMOUNT | syscalls.MS_BIND | syscalls.MS_RDONLY | _NOSUID_NODEV,
        None,
    )


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _real_dir(root: str, path: str) -> int:
    """``mkdir -p`` of ``path`` inside the new root, returning an fd of it.

    Each component is created and opened with ``O_NOFOLLOW`` below the one above it: the trees
    bound into the root view (the user's code bundle, the environment, the host's ``/usr``) may
    hold symlinks, and one followed here, as root and before pivot_root, would create a
    directory (and mount over it) on the host. A link on the way is an error naming it.
    """
    fd = os.open(root, _DIR_FLAGS)
    done = ""
    try:
        for part in path.split("/"):
            if not part:
                continue
            done += "/" + part
            try:  # noqa: SIM105 - contextlib is an import this stage does without
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise OSError(
                    exc.errno, f"{done} is a symlink or not a directory; not followed"
                ) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir(root: str, path: str) -> None:
    os.close(_real_dir(root, path))


def _make_file(root: str, path: str, mode: int) -> int:
    """Create (or open) the regular file ``path`` in the new root, never through a link."""
    parent = _real_dir(root, os.path.dirname(path))
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(os.path.basename(path), flags, mode, dir_fd=parent)
        except OSError as exc:
            raise OSError(exc.errno, f"{path} is a symlink or not a file; not followed") from None
    finally:
        os.close(parent)


def _apply_entry(root: str, entry: dict[str, Any], plan: Plan) -> None:
    kind = entry["kind"]
    path = entry["path"]
    dst = root + path
    if kind == "dir":
        _make_dir(root, path)
    elif kind == "symlink":
        parent = _real_dir(root, os.path.dirname(path))
        try:
            os.symlink(entry["target"], os.path.basename(path), dir_fd=parent)
        finally:
            os.close(parent)
    elif kind == "file":
        fd = _make_file(root, path, entry.get("mode", 0o644))
        try:  # plain writes: a text-mode file object costs more than the write itself
            view = memoryview(entry["content"].encode())
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, entry.get("mode", 0o644))
        finally:
            os.close(fd)
    elif kind == "bind":
        if os.path.isdir(entry["src"]):
            _make_dir(root, path)
        else:
            os.close(_make_file(root, path, 0o644))
        _bind(entry["src"], dst, entry["ro"])
    elif kind == "tmpfs":
        _make_dir(root, path)
        syscalls.mount("tmpfs", dst, "tmpfs", _NOSUID_NODEV, entry["options"])
    elif kind == "proc":
        if path != "/proc":  # /proc itself was mounted ahead (prepare_root)
            _make_dir(root, path)
            _mount_proc(dst)
    elif kind == "dev":
        if path != "/dev":
            _make_dir(root, path)
            _mount_dev(dst, [])
        _dev_nodes(dst, [n for n in entry["nodes"] if path != "/dev" or n not in DEV_NODES])
    else:
        raise ValueError(f"unknown layout entry kind {kind!r}")


def _bind(src: str, dst: str, ro: bool) -> None:
    """Bind ``src`` at ``dst`` (made already, never through a link: :func:`_apply_entry`),
    then :func:`_restrict`."""
    syscalls.mount(src, dst, None, syscalls.MS_BIND | syscalls.MS_REC, None)
    _restrict(dst, ro)


def _restrict(dst: str, ro: bool) -> None:
    """nosuid, nodev (and ``ro``: read-only) on the bind at ``dst`` and every mount below it."""
    # The bind is recursive (MS_REC), so whatever is mounted below its source comes along; a
    # remount changes only the top mount, which would leave those writable (a source above
    # DSEC_HOME would bring the node's pooled disk images in writable). Every mount of the
    # bind gets the flags, in one call where the kernel has mount_setattr.
    attrs = syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV
    if ro:
        attrs |= syscalls.MOUNT_ATTR_RDONLY
    try:
        syscalls.mount_setattr_recursive(dst, attrs)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        flags = syscalls.MS_REMOUNT | syscalls.MS_BIND | _NOSUID_NODEV
        if ro:
            flags |= syscalls.MS_RDONLY
        # such a remount sets a mount's flags to exactly these: each keeps its own too (a
        # mount the host made read-only below a writable bind's source stays read-only)
        kept = syscalls.mount_flags()
        for point in [dst, *syscalls.mounts_below(dst, kept)]:
            syscalls.mount(None, point, None, flags | kept.get(point, 0), None)


_PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")


def _mount_proc(dst: str) -> None:
    """This pid namespace's proc at the directory ``dst``, its host-wide files read-only."""
    syscalls.mount("proc", dst, "proc", _NOSUID_NODEV | syscalls.MS_NOEXEC, None)
    for name in _PROC_READONLY:
        path = f"{dst}/{name}"
        try:  # bound onto itself, then made read-only (no stat first: on every start's path)
            syscalls.mount(path, path, None, syscalls.MS_BIND | syscalls.MS_REC, None)
        except FileNotFoundError:
            continue  # not on this kernel (sysrq-trigger without CONFIG_MAGIC_SYSRQ)
        _restrict(path, ro=True)


def _dev_nodes(dst: str, nodes: list[str]) -> None:
    """The host's device nodes ``nodes`` (names under ``/dev``) made again in the sandbox's
    /dev (a tmpfs without ``nodev``): the same device numbers and permission bits, no mount
    each (two calls instead of a file, a bind mount and their Python). Only root in the host's
    user namespace may; the sandbox cannot (no ``CAP_MKNOD``)."""
    dev = os.open(dst, _DIR_FLAGS)
    mask = os.umask(0)  # the host's permission bits exactly (0666 for null, tty, ...)
    try:
        for node in nodes:
            # Below the sandbox's /dev fd, never through a link: a name is one or two
            # components without dots (SandboxConfig checks it; checked again here, as root).
            parts = node.split("/")
            if len(parts) > 2 or any(not p or p.startswith(".") for p in parts):
                raise OSError(errno.EINVAL, f"{node!r} is not a device name under /dev")
            host = os.stat(f"/dev/{node}")
            if not (stat.S_ISCHR(host.st_mode) or stat.S_ISBLK(host.st_mode)):
                raise OSError(errno.ENODEV, f"/dev/{node} is not a device node")
            parent = dev
            if len(parts) == 2:  # nvidia-caps/nvidia-capN: a MIG instance's capability
                try:  # noqa: SIM105 - contextlib is an import this stage does without
                    os.mkdir(parts[0], 0o755, dir_fd=dev)
                except FileExistsError:
                    pass
                parent = os.open(parts[0], _DIR_FLAGS, dir_fd=dev)
            try:
                mode = stat.S_IFMT(host.st_mode) | stat.S_IMODE(host.st_mode)
                os.mknod(parts[-1], mode, host.st_rdev, dir_fd=parent)
            finally:
                if parent != dev:
                    os.close(parent)
    finally:
        os.umask(mask)
        os.close(dev)


def _mount_dev(dst: str, nodes: tuple[str, ...] | list[str]) -> None:
    """A fresh /dev (tmpfs) at the directory ``dst`` with ``nodes`` bound from the host's."""
    syscalls.mount("tmpfs", dst, "tmpfs", syscalls.MS_NOSUID, "mode=0755,size=64k")
    _dev_nodes(dst, list(nodes))
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dst}/{name}")
    os.mkdir(f"{dst}/shm")
    syscalls.mount("tmpfs", f"{dst}/shm", "tmpfs", _NOSUID_NODEV, "mode=1777,size=64m")


# ----------------------------------------------------------------------------- the workload


def _confine_early(plan: Plan, report: _Reporter, holder_fd: int = -1) -> None:
    """The confinement that needs neither the sandbox's cgroups nor its root view: lowered
    limits, empty capability bounding and ambient sets, ``no_new_privs``, then the seccomp
    filter (whose listener, with ``holder_fd``, goes to the supervisor). The process keeps its
    uid and effective capabilities for :func:`_exec_workload`, which sets its cwd as root.
    Never returns on failure: reports it and exits 127."""
    stage = "credentials"
    try:
        start = time.monotonic_ns()
        _limit(plan)
        report.stage(stage, start)
        stage, start = "seccomp", time.monotonic_ns()
        listener = seccomp.install(bytes.fromhex(plan["seccomp"]), listener=holder_fd >= 0)
        if listener >= 0:
            _hand_over(listener, holder_fd)
        report.stage(stage, start)
    except BaseException as exc:
        _fail(report, stage, exc)


def _limit(plan: Plan) -> None:
    """Lowered limits, empty capability bounding and ambient sets, ``no_new_privs``: the first
    of the confinement every process of the sandbox gets (the workload's, the reaper's)."""
    nofile = plan.get("nofile")
    if nofile:  # lowered, soft and hard: not the node agent's own (high) limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    syscalls.drop_capabilities(plan["cap_last_cap"])
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)


def _build_landlock(plan: Plan, report: _Reporter, root_fd: int) -> int:
    """The sandbox's Landlock ruleset, its paths resolved in the root view whose detached copy
    ``root_fd`` is (:func:`_send_bound`); its fd, or -1 where the kernel lacks ``openat2`` or a
    lookup kept being interrupted (``EAGAIN``: a mount or rename anywhere on the host during a
    ``..``): then :func:`_exec_workload` builds it after the pivot, as the sandbox's root.
    Never returns on another failure: reports it and exits 127."""
    start = time.monotonic_ns()
    try:
        ruleset = _ruleset(plan, root_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EAGAIN):
            return -1
        _fail(report, "landlock", exc)
    except BaseException as exc:
        _fail(report, "landlock", exc)
    report.stage("landlock", start)  # (a first record: the two add up)
    return ruleset


def _ruleset(plan: Plan, root_fd: int | None = None, signals: bool = True) -> int:
    """The plan's Landlock ruleset (:func:`.landlock.build_ruleset`), not yet enforced;
    ``signals``: scoped (none to a process outside the domain)."""
    policy = plan["landlock"]
    return landlock.build_ruleset(
        policy["read"],
        policy["write"],
        policy["tcp_connect_ports"],
        policy["abi"],
        policy.get("scope_abstract_unix", True),
        root_fd=root_fd,
        scope_signal=signals,
    )


def _exec_workload(
    plan: Plan, report: _Reporter, ruleset: int = -1, successor: int = -1
) -> NoReturn:
    """After :func:`_confine_early`: cwd, uid drop, Landlock (``ruleset``: built already, by
    :func:`_build_landlock`), execve. ``successor``: init's socket, where the workload may be
    spawned instead (:func:`_spawn_workload`). Never returns."""
    stage = "credentials"
    spawn = successor >= 0 and not plan.get("tty") and _spawn_sibling is not None
    try:
        start = time.monotonic_ns()
        if not spawn:  # (else the spawned process makes its own session)
            os.setsid()
        if plan.get("tty"):  # the pseudo-terminal on 0-2 becomes the controlling terminal
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        os.chdir(plan["cwd"])
        _settle_scheduling()
        if spawn:  # (the uid drop is the spawned process's: this one keeps root until it ends)
            os.umask(0o022)
        else:
            _drop_privileges(plan)
        report.stage(stage, start)  # (a second record: the two add up)
        stage, start = "landlock", time.monotonic_ns()
        if ruleset < 0:  # not built beside the pivot: resolved here, as the sandbox's root
            ruleset = _ruleset(plan)
        try:
            landlock.enforce(ruleset, plan["landlock"]["abi"])
        finally:
            os.close(ruleset)
        report.stage(stage, start)
        if plan.get("transfer") is not None:  # `dsec sandbox cp`: copy, confined, no execve
            from dsec_nodeagent.sandbox import transfer

            stage = "copy"
            os._exit(transfer.serve(plan["transfer"]))
        stage = "exec"
        report.send(stage="exec", start_ns=time.monotonic_ns())
        # The report pipe is close-on-exec: the node agent's EOF is the signal that execve worked.
        if report.fd >= 0:
            os.set_inheritable(report.fd, False)
        _default_signals()
        if spawn:
            _spawn_workload(plan, report, successor)
        os.execve(plan["argv"][0], plan["argv"], plan["env"])
    except BaseException as exc:
        _fail(report, stage, exc)


def _spawn_workload(plan: Plan, report: _Reporter, successor: int) -> NoReturn:
    """The workload's ``execve`` in a sibling of this process that shares its memory
    (:mod:`._spawn`: ``clone(CLONE_VM | CLONE_VFORK | CLONE_PARENT)``): init's child from its
    first instruction, in a session of its own, with everything this process holds (namespaces,
    cgroups, limits, no capabilities in its bounding set, ``no_new_privs``, seccomp, Landlock:
    all inherited). It drops to the sandbox's uid itself; this process keeps root until it
    ends, so the workload cannot stop or kill it (another uid) before it told init the pid
    (``successor``: init reads it before it reaps anything).

    An ``execve`` of this process itself first tears its memory down (a forked interpreter's,
    tens of MB: 1-2 ms on the project's VM) before the workload's first instruction; here that
    is left to this process's exit, at ``SCHED_IDLE``, beside the workload. A failed
    ``execve`` raises here, as ``os.execve`` would."""
    env = []
    for name, value in plan["env"].items():
        if not name or "=" in name:  # (os.execve's own check)
            raise ValueError(f"illegal environment variable name {name!r}")
        env.append(os.fsencode(name) + b"=" + os.fsencode(value))
    argv = [os.fsencode(arg) for arg in plan["argv"]]
    assert _spawn_sibling is not None
    try:
        pid = _spawn_sibling(argv[0], argv, env, plan["uid"], plan["gid"])
    except OSError as exc:  # named by the path as given, as os.execve names it
        raise OSError(exc.errno, exc.strerror, plan["argv"][0]) from None
    report.close()  # (the node agent's EOF: the workload runs)
    os.write(successor, SPAWNED + str(pid).encode())
    try:  # noqa: SIM105
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass
    os._exit(0)


def _fail(report: _Reporter, stage: str, exc: BaseException) -> NoReturn:
    """Report the failing ``stage`` (on stderr when there is no report pipe), exit 127."""
    message = _describe(exc)
    if report.fd < 0:
        os.write(2, f"dsec sandbox: {stage} failed: {message}\n".encode())
    report.send(error=message, stage=stage)
    os._exit(127)


def _hand_over(listener: int, holder_fd: int) -> None:
    """Send the listener to the supervisor; keep no copy (the workload must not answer itself)."""
    import _socket

    holder = _socket.socket(fileno=holder_fd)
    try:
        holder.sendmsg(
            [b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, listener.to_bytes(4, sys.byteorder))]
        )
    finally:
        holder.close()
        os.close(listener)


def _settle_scheduling() -> None:
    """The workload's scheduling policy, set before its uid drop (after it, this process may no
    longer change it): the one it had before :func:`_prefault` (``SCHED_IDLE`` would outlive
    the ``execve``)."""
    if _POLICY_BEFORE is not None and (
        os.sched_getscheduler(0) != _POLICY_BEFORE[0] or os.sched_getparam(0) != _POLICY_BEFORE[1]
    ):
        os.sched_setscheduler(0, *_POLICY_BEFORE)


def _no_realtime() -> None:
    """``SCHED_OTHER`` at priority 0 for a pre-exec stage started at a realtime policy (a node
    agent's may be one), before it forks anything: a sandbox's code must not take a CPU from
    the node, and on a kernel with realtime group scheduling a realtime task cannot join a
    sandbox's cgroup at all (each launch failed with init's ``EINVAL``). Every sandbox process
    descends from this one; other policies (``SCHED_BATCH``, a nice value) are kept."""
    if os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _default_signals() -> None:
    """``SIGPIPE`` and ``SIGXFSZ`` back to their default action for the ``execve``: this
    interpreter's start-up ignores both, and an ignored signal stays ignored across
    ``execve`` (a sandbox's ``producer | head`` then got ``EPIPE`` errors instead of ending
    quietly; a file past its size limit ``EFBIG`` instead of the signal). As ``subprocess``'s
    ``restore_signals``."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)


def _drop_privileges(plan: Plan) -> None:
    """The sandbox's uid and gid, no capabilities (after :func:`_confine_early`)."""
    uid, gid = plan["uid"], plan["gid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    os.umask(0o022)


# ----------------------------------------------------------------------------- exec


_NS_ORDER = ("ipc", "uts", "net", "pid", "mnt")
_NS_FLAGS = {
    "ipc": syscalls.CLONE_NEWIPC,
    "uts": syscalls.CLONE_NEWUTS,
    "net": syscalls.CLONE_NEWNET,
    "pid": syscalls.CLONE_NEWPID,
    "mnt": syscalls.CLONE_NEWNS,
}


def exec_into(plan: Plan, report: _Reporter) -> int:
    """Join a running sandbox (namespaces + cgroups) and run a command with its confinement."""
    target = plan["join_pid"]
    # Nothing of the host can be imported once in the sandbox's mount namespace (nothing at all
    # once sealed, below): what the confined child needs for a copy is imported here.
    if plan.get("transfer") is not None:
        from dsec_nodeagent.sandbox import transfer  # noqa: F401
    fds = {ns: os.open(f"/proc/{target}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC) for ns in _NS_ORDER}
    _join_cgroups(plan["cgroup_procs"])
    _seal_imports()
    for ns in _NS_ORDER:
        if ns != "net" or plan["unshare_net"]:
            syscalls.setns(fds[ns], _NS_FLAGS[ns])
        os.close(fds[ns])
    pid = os.fork()  # the pid namespace applies to children only
    if pid == 0:
        _confine_early(plan, report)
        _exec_workload(plan, report)
    report.close()
    signal.signal(signal.SIGINT, lambda *_: os.kill(pid, signal.SIGINT))
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# ----------------------------------------------------------------------------- the zygote

# To the zygote, one request per sandbox: the word "fork" and one fd (SCM_RIGHTS), the child's
# end of a stream socket of its own. The answer: the child's pid (text) and a pidfd of it.
# Over that socket the child, once it has forked init, sends the word "init" and its end of
# init's plan socket, on which the node agent sends init the report pipe's write end and the
# read end of the go pipe (SCM_RIGHTS, with the first bytes), the marshalled plan, then EOF.
# Then, over the child's socket, the report pipe's write end and the stdout and stderr log
# files, the plan, EOF. The go: one byte once the whole hand-over went through and the hooks on
# the sandbox's cgroups (made before it) are done (init binds the root view meanwhile, and
# joins the cgroups only then); EOF without it: init exits.
HANDOVER_FDS = 3


def zygote(sock_fd: int, root: str) -> int:
    """Fork one supervisor per request; never read a plan.

    Started once per node agent (a fresh interpreter with a clean environment, holding only the
    control socket ``sock_fd``), it has paid the interpreter's start and these modules' imports
    once; each sandbox then costs a fork, requested before the node agent plans the sandbox so
    that the two overlap. It never sees a plan (the child receives it on its own socket), so no
    sandbox's secrets pass through, or linger in, the process later sandboxes are forked from.
    EOF on the control socket (the node agent went away) ends it.
    """
    import _socket
    import gc
    import json  # noqa: F401  (the reports' encoder: see _Reporter)
    import select  # noqa: F401  (the supervisor's pump)

    sock = _socket.socket(fileno=sock_fd)

    def reap(_signum: int, _frame: object) -> None:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the node agent's to handle
    gc.collect()
    gc.freeze()  # children share these pages instead of copying them at their first collection
    while True:
        try:
            msg, fds = _recv_fds(sock, 16, 1)
        except OSError:
            return 1
        if not msg:
            return 0  # the node agent closed its end
        if msg != b"fork" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            sock.sendmsg([b"error: expected 'fork' and one fd"])
            continue
        # SIGCHLD waits until the pidfd exists: a child failing at once is not reaped before.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            _zygote_child(sock, fds[0], root)
        os.close(fds[0])
        pidfd = os.pidfd_open(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        try:
            sock.sendmsg(
                [str(pid).encode()],
                [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))],
            )
        except OSError:
            return 1
        finally:
            os.close(pidfd)


def _recv_fds(sock: Any, size: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One ``recvmsg``: the bytes and the fds that came with them (close-on-exec)."""
    import _socket

    msg, ancillary, _flags, _addr = sock.recvmsg(
        size, _socket.CMSG_SPACE(4 * max_fds), _socket.MSG_CMSG_CLOEXEC
    )
    fds = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [
                int.from_bytes(data[i : i + 4], sys.byteorder)
                for i in range(0, len(data) - len(data) % 4, 4)
            ]
    return msg, fds


def _zygote_child(control: Any, channel_fd: int, root: str) -> None:
    """The supervisor, fresh from the zygote: shed its state, wait for the plan, then as ``run``.

    Never returns. Before anything else it closes the zygote's control socket and every fd but
    its own channel, restores the signal dispositions and mask, and starts a session of its own:
    it then holds what a spawned pre-exec stage holds.
    """
    import _socket

    code = 126
    try:
        control.close()  # no sandbox process may ever hold the zygote's socket
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())  # execve would pass a mask on
        os.setsid()
        null = os.open("/dev/null", os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        _close_all_but({0, 1, 2, channel_fd})
        # The sandbox's plan-independent part, made while the node agent plans (init holds
        # none of this process's fds but /dev/null).
        prepared = prepare(root, [channel_fd], ahead=True)
        # Init's plan comes straight from the node agent (see HANDOVER_FDS).
        channel = _socket.socket(fileno=channel_fd)
        try:
            init_sock = prepared.plan_sock.fileno().to_bytes(4, sys.byteorder)
            channel.sendmsg(
                [b"init %d" % prepared.init_pid],
                [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, init_sock)],
            )
        finally:
            channel.detach()
        prepared.plan_sock.close()
        prepared.plan_sock = None
        plan, fds = _receive_plan(channel_fd)
        if len(fds) != HANDOVER_FDS:  # the launch was given up before its plan was sent
            for fd in fds:
                os.close(fd)
            abandon(prepared)
            return
        report_fd, out_fd, err_fd = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        report = _Reporter(report_fd)  # (the "spawn" stage: init's, which has its plan first)
        try:
            code = supervise(prepared, marshal.loads(plan), report, plan)
        except Exception as exc:
            report.send(error=f"{type(exc).__name__}: {exc}", stage="supervisor")
    finally:
        os._exit(code)


def _close_all_but(keep: set[int]) -> None:
    """Close every fd of this process not in ``keep`` (whatever the zygote held)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:  # noqa: SIM105
                os.close(fd)
            except OSError:
                pass  # the listing's own fd, already closed


def _read_exact(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd`` (EOF before them: ``EOFError``); at most :data:`SHARED_MAX`."""
    if not 0 <= size <= SHARED_MAX:
        raise ValueError(f"{size} bytes announced: more than {SHARED_MAX}")
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError(f"{left} of {size} bytes missing")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive_plan(channel_fd: int, max_fds: int = HANDOVER_FDS) -> tuple[bytes, list[int]]:
    """The plan and the hand-over fds (from the node agent, or the supervisor), until EOF."""
    import _socket

    sock = _socket.socket(fileno=channel_fd)
    chunks = []
    fds: list[int] = []
    try:
        while True:
            data, more = _recv_fds(sock, 1 << 16, max_fds)
            fds += more
            if not data:
                break
            chunks.append(data)
    finally:
        sock.close()
    return b"".join(chunks), fds


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``init run|exec PLAN_FD REPORT_FD`` or ``init zygote SOCKET_FD ROOT_DIR``
    (``ROOT_DIR``: an empty directory only the node agent writes, where each sandbox's init
    mounts its root tmpfs, in its own mount namespace)."""
    args = sys.argv[1:] if argv is None else argv
    _no_realtime()
    if len(args) == 3 and args[0] == "zygote":
        syscalls.check_arch()
        return zygote(int(args[1]), args[2])
    if len(args) != 3 or args[0] not in ("run", "exec"):
        print(
            "usage: python -m dsec_nodeagent.sandbox.init run|exec PLAN_FD REPORT_FD"
            " | zygote SOCKET_FD ROOT_DIR",
            file=sys.stderr,
        )
        return 2
    syscalls.check_arch()
    return _serve(args)


def _serve(args: list[str]) -> int:
    report = _Reporter(int(args[2]))
    report.send(stage="spawn", end_ns=time.monotonic_ns())
    try:
        plan = _read_plan(int(args[1]))
        return run(plan, report) if args[0] == "run" else exec_into(plan, report)
    except Exception as exc:
        report.send(error=f"{type(exc).__name__}: {exc}", stage="supervisor")
        return 126


if __name__ == "__main__":
    sys.exit(main())
