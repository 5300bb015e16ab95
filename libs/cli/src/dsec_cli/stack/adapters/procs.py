"""Processes and ports: spawn detached, recognise a process across CLI invocations, stop it with
a deadline, poll until a condition holds, pick free loopback ports."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import os
import queue
import random
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import psutil

from dsec_cli.stack.errors import StackError

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
POLL_INTERVAL_S = 0.02


def _set_pdeathsig() -> None:
    """In the child: die with SIGTERM when the parent thread exits (test servers only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class ProcessRef:
    """A process started by the stack, recognisable by another ``dsec`` invocation.

    ``create_time`` guards against pid reuse: a pid whose start time differs is not ours.
    ``popen`` is set only in the process that spawned it (it reaps the child).
    """

    pid: int
    create_time: float
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        """Whether the process still runs (a zombie counts as gone)."""
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.05:
                return False
            return bool(proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def returncode(self) -> int | None:
        """Exit status when it was our child and has exited, else ``None``."""
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process (no error when it is already gone)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group the process leads (it was started in a new session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def wait_gone(self, deadline: float) -> bool:
        """Wait until the process is gone or ``deadline`` (monotonic) passes.

        Woken by the process' exit itself where the kernel offers a pidfd (Linux 5.3+): a
        stack's ``down`` waits for each process as long as it takes to exit, not up to a
        polling interval more. Polls where it does not."""
        if not self.alive():
            return True
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd here, or the process just went
            return poll_until(lambda: not self.alive(), deadline)
        try:
            # the pid is the one checked above, unless it exited and was reused in between
            if not self.alive():
                return True
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while (left := deadline - time.monotonic()) > 0:
                if poller.poll(max(1, round(min(left, 1.0) * 1000))):
                    break  # exited (a zombie, for our own child: alive() reaps it)
            return not self.alive()
        finally:
            os.close(fd)

    def rss_bytes(self) -> int:
        """Resident memory of the process and all its descendants (0 when gone)."""
        try:
            proc = psutil.Process(self.pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total


def process_ref(pid: int | None, create_time: float | None) -> ProcessRef | None:
    """Rebuild a reference from ``stack.json`` fields, or ``None`` when there is none."""
    if pid is None or create_time is None:
        return None
    return ProcessRef(pid=pid, create_time=create_time)


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str],
    cwd: Path | None = None,
    stdout_to_log: bool = True,
    die_with_parent: bool = False,
) -> ProcessRef:
    """Start ``argv`` in its own session, its output appended to ``log_path``.

    Args:
        argv: the command.
        log_path: log file (created; a header line marks each start).
        env: complete environment of the child.
        cwd: working directory.
        stdout_to_log: when False stdout goes to /dev/null (only stderr is logged), for servers
            that print secrets on stdout.
        die_with_parent: the child gets SIGTERM when this process dies (PR_SET_PDEATHSIG), so a
            killed pytest leaves no server behind. The signal fires when the *thread* that forked
            exits, so such children are forked by one long-lived thread.

    Raises:
        StackError: the binary cannot be executed.
    """
    if die_with_parent:
        return _spawner().submit(argv, log_path, env, cwd, stdout_to_log)
    return _spawn(argv, log_path, env, cwd, stdout_to_log, die_with_parent=False)


def _spawn(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    cwd: Path | None,
    stdout_to_log: bool,
    *,
    die_with_parent: bool,
) -> ProcessRef:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes]
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} start {argv[0]}\n".encode())
        log.flush()
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log if stdout_to_log else subprocess.DEVNULL,
                stderr=log,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_set_pdeathsig if die_with_parent else None,
            )
        except OSError as exc:
            raise StackError(f"cannot execute {argv[0]}: {exc.strerror}") from None
    try:
        created = psutil.Process(popen.pid).create_time()
    except psutil.Error:
        created = time.time()
    return ProcessRef(pid=popen.pid, create_time=created, popen=popen)


class _Spawner:
    """One daemon thread that forks every die-with-parent child (see :func:`spawn`)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], ProcessRef], concurrent.futures.Future[ProcessRef]]
        ] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="dsec-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self._queue.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def submit(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path | None,
        stdout_to_log: bool,
    ) -> ProcessRef:
        fut: concurrent.futures.Future[ProcessRef] = concurrent.futures.Future()
        self._queue.put(
            (lambda: _spawn(argv, log_path, env, cwd, stdout_to_log, die_with_parent=True), fut)
        )
        return fut.result()


_spawner_instance: _Spawner | None = None
_spawner_lock = threading.Lock()


def _spawner() -> _Spawner:
    global _spawner_instance
    with _spawner_lock:
        if _spawner_instance is None:
            _spawner_instance = _Spawner()
        return _spawner_instance


def stop_process(ref: ProcessRef, *, sig: int = signal.SIGTERM, timeout: float = 10.0) -> bool:
    """Stop a process: ``sig``, wait up to ``timeout``, then SIGKILL its whole process group.

    Returns:
        True when the process is gone.
    """
    if ref.alive():
        ref.signal(sig)
        if not ref.wait_gone(time.monotonic() + timeout):
            ref.signal_group(signal.SIGKILL)
            ref.signal(signal.SIGKILL)
            ref.wait_gone(time.monotonic() + 5.0)
    # Children left in the group (e.g. Postgres backends after a SIGKILLed postmaster).
    if _group_has_members(ref.pid):
        ref.signal_group(signal.SIGKILL)
    if ref.popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            ref.popen.wait(timeout=1.0)
    return not ref.alive()


def _group_has_members(pgid: int) -> bool:
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):  # it exited meanwhile
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def poll_until(
    check: Callable[[], bool], deadline: float, interval: float = POLL_INTERVAL_S
) -> bool:
    """Call ``check`` until it returns True or the monotonic ``deadline`` passes.

    The interval grows slowly (to at most 0.2 s) so quick starts are seen quickly and slow ones
    do not burn CPU.
    """
    delay = interval
    while True:
        if check():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 1.5, 0.2)


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ('' when missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - 16384, 0))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


# --- ports ---------------------------------------------------------------------------------------

_reserved: set[int] = set()
_reserved_lock = threading.Lock()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now.

    SO_REUSEADDR mirrors what the servers do, so sockets in TIME_WAIT do not count as taken.
    """
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def port_listening(port: int, host: str = "127.0.0.1", timeout: float = 0.3) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((host, port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str | None:
    """'pid N (name)' of the process listening on ``port``, when the OS lets us see it."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return None
                with contextlib.suppress(psutil.Error):
                    return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                return f"pid {conn.pid}"
    return None


def _port_range() -> tuple[int, int]:
    """Ports to pick from: below the kernel's ephemeral range, leaving room for +10000 siblings
    (SeaweedFS opens HTTP port + 10000 for gRPC), so outgoing connections never steal them."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    hi = low - 10001
    if hi - 12000 < 2000:
        return 12000, 22000
    return 12000, hi


def allocate_ports(count: int, offsets: Iterable[int] = (0,)) -> list[int]:
    """Pick ``count`` free loopback ports such that ``port + offset`` is free for every offset.

    Ports handed out by this process are remembered so parallel allocations never collide.

    Raises:
        StackError: no free ports were found.
    """
    offs = tuple(offsets)
    lo, hi = _port_range()
    rng = random.SystemRandom()
    chosen: list[int] = []
    with _reserved_lock:
        for _ in range(2000):
            if len(chosen) == count:
                break
            base = rng.randrange(lo, hi)
            group = [base + off for off in offs]
            if any(p in _reserved or p >= 65536 for p in group):
                continue
            if all(port_is_free(p) for p in group):
                chosen.append(base)
                _reserved.update(group)
        if len(chosen) < count:
            raise StackError(f"could not find {count} free loopback ports in {lo}-{hi}")
    return chosen


def release_ports(ports: Iterable[int], offsets: Iterable[int] = (0,)) -> None:
    """Forget ports reserved by :func:`allocate_ports` (after the server using them stopped)."""
    offs = tuple(offsets)
    with _reserved_lock:
        for port in ports:
            for off in offs:
                _reserved.discard(port + off)


def run_parallel(tasks: Mapping[str, Callable[[], T]]) -> dict[str, T | BaseException]:
    """Run named callables on threads and return each result or the exception it raised."""
    results: dict[str, T | BaseException] = {}
    lock = threading.Lock()

    def runner(name: str, fn: Callable[[], T]) -> None:
        try:
            value: T | BaseException = fn()
        except BaseException as exc:
            value = exc
        with lock:
            results[name] = value

    threads = [
        threading.Thread(target=runner, args=(name, fn), name=f"dsec-stack-{name}", daemon=True)
        for name, fn in tasks.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
